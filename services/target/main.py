"""`specd serve target`: the target service process."""

from __future__ import annotations

import logging

import grpc

from services.common.server import serve_until_signal, start_server
from services.common.settings import TargetSettings
from services.proto.specd.target.v1 import target_pb2_grpc
from services.target.servicer import SERVICE_NAME, TargetServicer

log = logging.getLogger(__name__)


def build_servicer(s: TargetSettings) -> TargetServicer:
    import torch

    from specd.models import load_model

    if s.threads:
        torch.set_num_threads(s.threads)
    target = load_model(s.model, s.device, s.dtype, s.cache_dir, s.linear_kernels, s.forward)
    return TargetServicer(target, s.max_batch_size)


async def start(s: TargetSettings, servicer: TargetServicer) -> tuple[grpc.aio.Server, int]:
    """Start serving; returns the server and the port it listens on."""
    server, port = await start_server(SERVICE_NAME, target_pb2_grpc.add_TargetServiceServicer_to_server, servicer,
                                      s.host, s.port, servicer.rpc_metrics.observe)
    log.info("target service (%s) listening on %s:%d", servicer.target.name, s.host, port)
    return server, port


async def serve(s: TargetSettings) -> None:
    servicer = build_servicer(s)
    server, port = await start(s, servicer)
    await serve_until_signal("target", server, port, servicer.registry, s.host, s.metrics_port)
    servicer.close()
