"""`specd serve draft`: the draft service process."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.common.compute import build_on, compute_thread
from services.common.security import GrpcSecurity
from services.common.server import serve_until_signal, start_server
from services.common.settings import DraftSettings, parse_load_caps
from services.draft.servicer import SERVICE_NAME, DraftServicer
from services.proto.specd.draft.v1 import draft_pb2_grpc
from specd.errors import InvalidRequest

log = logging.getLogger(__name__)


def build_servicer(s: DraftSettings, executor: ThreadPoolExecutor | None = None) -> DraftServicer:
    """Load the drafter and measure it; run on the compute thread (services.common.compute)."""
    import torch

    from specd.drafters import build_drafter
    from specd.drafters.early_exit import EarlyExitDrafter
    from specd.runtime import load_model
    from specd.runtime.arch import unsupported
    from specd.runtime.lean import supports
    from specd.runtime.loading import model_name
    from specd.policies import AcceptanceHead, bundled_head_path

    if s.dvi:  # checked before loading anything
        if s.drafter != "early-exit":  # `specd serve trainer` trains the early-exit drafter's head
            raise InvalidRequest("dvi", f"online learning needs --drafter early-exit, not {s.drafter}")
        if not s.redis_url:
            raise InvalidRequest("redis_url", "online learning (dvi) keeps its replay stream in Redis; set redis_url")
    if s.threads:
        torch.set_num_threads(s.threads)
    model = draft_model = None
    if s.drafter in ("early-exit", "feature", "hybrid"):
        model = load_model(s.target_model, s.device, s.dtype, s.cache_dir, s.linear_kernels, s.forward,
                           cuda_graphs="off")
    elif s.drafter == "hf":
        model = draft_model = load_model(s.draft_model or "", s.device, s.dtype, s.cache_dir, s.linear_kernels,
                                         s.forward, cuda_graphs="off")  # sessions without a slot cap
    if draft_model is not None and s.kv_slots > 0:
        reason = unsupported(draft_model.model)
        if reason is not None:  # never a slower path without a cap on sessions: say what is missing
            raise InvalidRequest("draft_model", f"specd's runtime cannot serve {draft_model.name} exactly: {reason}")
        pool = draft_model.use_pool(s.kv_slots, s.kv_max_len, memory_fraction=s.kv_memory_fraction)
        log.info("draft %s (%s) on specd's runtime: KV pool of %d slots x %d positions", draft_model.name,
                 draft_model.model.config.model_type, pool.num_slots, pool.max_len)  # draft steps share forwards
    drafter = build_drafter(s.drafter, model, draft_model, s.draft_layers, s.draft_adapter, s.datastore,
                            model_name(s.target_model))
    if isinstance(drafter, EarlyExitDrafter) and s.kv_slots > 0 and supports(model.model):
        drafter.use_pool(s.kv_slots, s.kv_max_len)  # a pool of its own layers only
    head_path = s.specdecpp_head or bundled_head_path(drafter.name)
    head = AcceptanceHead.load(head_path).to(model.device) if head_path and model is not None else None
    dvi = None
    if s.dvi:
        from services.common.replay import RedisDVI

        dvi = RedisDVI(s.redis_url, drafter.name)
    return DraftServicer(drafter, model, head, dvi=dvi, dvi_poll_s=s.dvi_poll_s, executor=executor,
                         max_batch_size=s.max_batch_size, load_caps=parse_load_caps(s.load_draft_caps),
                         branches=s.branches)


async def start(s: DraftSettings, servicer: DraftServicer) -> tuple[grpc.aio.Server, int]:
    """Start serving; returns the server and the port it listens on."""
    server, port = await start_server(SERVICE_NAME, draft_pb2_grpc.add_DraftServiceServicer_to_server, servicer,
                                      s.host, s.port, servicer.rpc_metrics.observe, GrpcSecurity.from_settings(s),
                                      s.reflection)
    await servicer.start_learning()
    log.info("draft service (%s) listening on %s:%d", servicer.drafter.name, s.host, port)
    return server, port


async def serve(s: DraftSettings) -> None:
    servicer = await build_on(compute_thread("draft"), build_servicer, s)
    server, port = await start(s, servicer)
    await serve_until_signal("draft", server, port, servicer.registry, s.host, s.metrics_port, s.drain_grace_s)
    servicer.close()
