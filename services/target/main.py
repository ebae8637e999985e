"""`specd serve target`: the target service process."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.common.compute import build_on, compute_thread
from services.common.security import GrpcSecurity
from services.common.server import serve_until_signal, start_server
from services.common.settings import TargetSettings
from services.proto.specd.target.v1 import target_pb2_grpc
from services.target.servicer import SERVICE_NAME, TargetServicer

log = logging.getLogger(__name__)


def build_servicer(s: TargetSettings, executor: ThreadPoolExecutor | None = None) -> TargetServicer:
    """Load the model and measure it; run on the compute thread (services.common.compute)."""
    import torch

    from specd.models import load_model

    if s.threads:
        torch.set_num_threads(s.threads)
    target = load_model(s.model, s.device, s.dtype, s.cache_dir, s.linear_kernels, s.forward, cuda_graphs="off")
    use_pool(target, s)
    return TargetServicer(target, s.max_batch_size, prefill_chunk=s.prefill_chunk, gather=s.batch_gather,
                          executor=executor, latency_budget=s.latency_budget)


def use_pool(target, s: TargetSettings) -> None:
    """Open sessions in a preallocated KV pool (and capture CUDA graphs) where the settings and
    the model allow; otherwise sessions keep growing caches of their own."""
    from specd.models.lean import supports

    if s.kv_slots == 0:
        return
    if not supports(target.model):
        log.warning("target %s: no KV pool (the lean forward does not support this model)", target.name)
        return
    graphs = s.cuda_graphs == "on" or (s.cuda_graphs == "auto" and target.device.type == "cuda")
    pool = target.use_pool(s.kv_slots, s.kv_max_len, graphs=graphs)
    log.info("target KV pool: %d slots x %d positions, %.2f GiB", pool.num_slots, pool.max_len,
             pool.k.numel() * pool.k.element_size() * 2 / 2**30)
    if pool.graphs is not None:
        seconds = pool.graphs.capture(progress=log.info)
        log.info("CUDA graphs captured in %.1f s", seconds)


async def start(s: TargetSettings, servicer: TargetServicer) -> tuple[grpc.aio.Server, int]:
    """Start serving; returns the server and the port it listens on."""
    server, port = await start_server(SERVICE_NAME, target_pb2_grpc.add_TargetServiceServicer_to_server, servicer,
                                      s.host, s.port, servicer.rpc_metrics.observe, GrpcSecurity.from_settings(s),
                                      s.reflection)
    log.info("target service (%s) listening on %s:%d", servicer.target.name, s.host, port)
    return server, port


async def serve(s: TargetSettings) -> None:
    servicer = await build_on(compute_thread("target"), build_servicer, s)
    server, port = await start(s, servicer)
    await serve_until_signal("target", server, port, servicer.registry, s.host, s.metrics_port, s.drain_grace_s)
    servicer.close()
