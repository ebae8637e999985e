"""`specd serve target`: the target service process."""

from __future__ import annotations

import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.common.compute import build_on, compute_thread
from services.common.security import GrpcSecurity
from services.common.server import serve_until_signal, start_server
from services.common.settings import TargetSettings
from services.proto.specd.target.v1 import target_pb2_grpc
from services.target.servicer import SERVICE_NAME, TargetServicer
from specd.errors import InvalidRequest

log = logging.getLogger(__name__)


def build_servicer(s: TargetSettings, executor: ThreadPoolExecutor | None = None) -> TargetServicer:
    """Load the model and measure it; run on the compute thread (services.common.compute)."""
    target = load_target(s)
    drafter = None
    if s.drafter != "none":
        from specd.drafters import build_drafter

        drafter = build_drafter(s.drafter, target, datastore=s.datastore)
    return TargetServicer(target, executor=executor, drafter=drafter, max_batch_size=s.max_batch_size,
                          prefill_chunk=s.prefill_chunk, gather=s.batch_gather, latency_budget=s.latency_budget,
                          max_window_tokens=s.max_window_tokens, idle_timeout_s=s.idle_timeout_s,
                          fair_share_reserve=s.kv_fair_share_reserve)


def load_target(s: TargetSettings):
    """The target model with its KV pool; under tensor parallelism this rank's shard (rank 0's
    pool mirrors its forwards to the other ranks)."""
    import torch

    from specd.runtime import load_model
    from specd.runtime.loading import resolve_device
    from specd.runtime.tp import TensorParallel

    tp = TensorParallel.from_env() if s.tensor_parallel > 1 else None
    if s.threads:
        torch.set_num_threads(s.threads)
    elif tp is not None:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp.world))
    if tp is not None:
        if s.kv_slots == 0:
            raise InvalidRequest("kv_slots", "a tensor-parallel target runs over a KV pool; set kv_slots > 0")
        tp.init(resolve_device(s.device))
    target = load_model(s.model, s.device, s.dtype, s.cache_dir, s.linear_kernels, s.forward, cuda_graphs="off",
                        tensor_parallel=tp)
    use_pool(target, s, graphs_allowed=tp is None, tp=tp)
    if s.virtual_replay is not None and s.virtual_device is None:
        raise InvalidRequest("virtual_replay", "a replay is a virtual device's; set virtual_device too")
    if s.virtual_device is not None:
        from specd.runtime.virtual import DeviceProfile, Replay, VirtualDevice

        if target.pool is None:
            raise InvalidRequest("virtual_device", "a virtual device times the KV pool's forwards; set kv_slots > 0")
        replay = Replay.load(s.virtual_replay) if s.virtual_replay is not None else None
        target.pool.virtual = VirtualDevice(DeviceProfile.load(s.virtual_device), replay)
        log.info("target %s: every forward takes the time of the device profile %s%s", target.name, s.virtual_device,
                 f", its logits replaying {len(replay.next)} recorded tokens" if replay else "")
    if tp is not None and target.pool is None:
        raise InvalidRequest("tensor_parallel", "the model has no KV pool (the lean forward does not support it)")
    if tp is not None and tp.leader:
        target.pool.tp = tp
    return target


def use_pool(target, s: TargetSettings, graphs_allowed: bool = True, tp=None) -> None:
    """Open sessions in a preallocated KV pool (and capture CUDA graphs) where the settings and
    the model allow; otherwise sessions keep growing caches of their own. tp: the ranks agree on
    the slots that fit on every one of them."""
    from specd.runtime.arch import unsupported

    if s.kv_slots == 0:
        log.warning("target %s: kv_slots 0, no KV pool: sessions grow their own caches, and nothing caps "
                    "their number or memory", target.name)
        return
    reason = unsupported(target.model)
    if reason is not None:  # never a slower path without admission: say what is missing
        raise InvalidRequest("model", f"specd's runtime cannot serve {target.name} exactly: {reason}")
    graphs = graphs_allowed and (s.cuda_graphs in ("on", "compiled")
                                 or (s.cuda_graphs == "auto" and target.device.type == "cuda"))
    if graphs:  # auto: each layer through torch.compile, as `compiled`, falling back to plain graphs
        compiled = "on" if s.cuda_graphs in ("auto", "compiled") else "off"
    else:
        compiled = s.cpu_compile if graphs_allowed else "off"
    slots, fraction = s.kv_slots, s.kv_memory_fraction
    if tp is not None:
        from specd.runtime.loading import slots_that_fit
        from specd.runtime.tp import agree

        length = min(s.kv_max_len, target.max_context)
        slots, fraction = agree(tp, slots_that_fit(target.model.config, target.model.dtype, target.device, slots,
                                                   length, fraction)), None
    pool = target.use_pool(slots, s.kv_max_len, graphs=graphs, compiled=compiled, cache_dir=s.cache_dir,
                           memory_fraction=fraction)
    log.info("target %s (%s) on specd's runtime: KV pool of %d slots x %d positions, %.2f GiB", target.name,
             target.model.config.model_type, pool.num_slots, pool.max_len,
             pool.k.numel() * pool.k.element_size() * 2 / 2**30)
    if graphs:  # every bucket, before serving: a running server never captures one
        seconds = capture_graphs(pool.runner, fallback=s.cuda_graphs == "auto")
        pool.runner.lazy = False
        log.info("%d CUDA graphs captured in %.1f s", len(pool.runner.graphs), seconds)
    elif pool.runner is not None:
        log.info("target forwards compiled for the CPU: %s", pool.runner.path)


def capture_graphs(runner, fallback: bool) -> float:
    """Capture the runner's graphs at start-up (the seconds it took). fallback: where compiling
    the layers fails (no Triton or no C compiler on the machine, a torch that cannot compile
    them), warn and capture plain layers instead of failing to start."""
    try:
        return runner.capture(progress=log.info)
    except Exception as e:  # whatever torch.compile raised: plain graphs still serve
        if not fallback or runner.pool.compiled_layer is None:
            raise
        log.warning("compiling the target's layers failed (%s: %s); plain CUDA graphs instead",
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        runner.uncompile()
        return runner.capture(progress=log.info)


async def start(s: TargetSettings, servicer: TargetServicer) -> tuple[grpc.aio.Server, int]:
    """Start serving; returns the server and the port it listens on."""
    server, port = await start_server(SERVICE_NAME, target_pb2_grpc.add_TargetServiceServicer_to_server, servicer,
                                      s.host, s.port, servicer.rpc_metrics.observe, GrpcSecurity.from_settings(s),
                                      s.reflection)
    log.info("target service (%s) listening on %s:%d", servicer.target.name, s.host, port)
    return server, port


async def serve(s: TargetSettings) -> None:
    if s.tensor_parallel > 1:
        from specd.runtime.tp import TensorParallel, follow, stop_followers

        tp = TensorParallel.from_env()
        if tp is None:  # start the ranks: this command again under torchrun, one process per rank
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={s.tensor_parallel}", "-m", "specd", *sys.argv[1:]]
            log.info("tensor parallel over %d ranks: %s", s.tensor_parallel, " ".join(argv))
            os.execv(sys.executable, argv)
        if tp.world != s.tensor_parallel:
            raise InvalidRequest("tensor_parallel", f"launched with {tp.world} ranks, asked for {s.tensor_parallel}")
        if not tp.leader:
            follow(load_target(s).pool, tp)  # the forwards rank 0 broadcasts, until it stops
            tp.close()
            return
    servicer = await build_on(compute_thread("target"), build_servicer, s)
    server, port = await start(s, servicer)
    await serve_until_signal("target", server, port, servicer.registry, s.host, s.metrics_port, s.drain_grace_s)
    servicer.close()
    if s.tensor_parallel > 1:
        await build_on(servicer.core.executor, lambda _executor: stop_followers(tp))
        tp.close()
