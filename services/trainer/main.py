"""`specd serve trainer`: the DVI trainer (docs/engine.md, "Online learning (DVI)").

It reads the replay stream draft services log judged draft positions to, makes
`updates_per_record` LoRA updates per record read (specd.dvi.DVITrainer: KL first, then KL
with reward-masked cross-entropy and a policy-gradient term), and every `publish_every`
updates publishes the adapter, which draft services running with `--dvi true` hot-swap. With
`--checkpoint FILE` it keeps its state (adapter, optimiser, stream position) there and
resumes from it. It exports its progress on /metrics:

  specd_dvi_trainer_records_total, specd_dvi_trainer_updates_total, specd_dvi_trainer_loss,
  specd_dvi_trainer_reward (the mean reward of the last batch: the acceptance rate of the
  logged positions), specd_dvi_adapter_version{drafter}
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge

from services.common.replay import RedisDVI
from services.common.settings import TrainerSettings
from services.common.state import REDIS_ERRORS
from specd.dvi import DVITrainer, TrainerConfig, trainer_for
from specd.errors import InvalidRequest

log = logging.getLogger(__name__)


class TrainerLoop:
    def __init__(self, trainer: DVITrainer, dvi: RedisDVI, updates_per_record: float, publish_every: int,
                 checkpoint=None, registry: CollectorRegistry | None = None, drafter: str = "-"):
        self.trainer, self.dvi = trainer, dvi
        self.updates_per_record, self.publish_every, self.checkpoint = updates_per_record, publish_every, checkpoint
        self.after = "0"  # stream position: from the oldest record kept
        self.debt = 0.0
        self.published = 0
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="dvi-train")
        self.registry = registry or CollectorRegistry()
        self.records = Counter("specd_dvi_trainer_records", "replay records read", registry=self.registry)
        self.updates = Counter("specd_dvi_trainer_updates", "LoRA updates made", registry=self.registry)
        self.loss = Gauge("specd_dvi_trainer_loss", "loss of the last update", registry=self.registry)
        self.reward = Gauge("specd_dvi_trainer_reward", "mean reward (acceptance) of the last batch",
                            registry=self.registry)
        self.version = Gauge("specd_dvi_adapter_version", "adapter version last published", ["drafter"],
                             registry=self.registry).labels(drafter)
        if checkpoint is not None and checkpoint.is_file():
            self._restore()

    async def run_once(self, count: int = 1024, block_ms: int | None = 1000) -> int:
        """Read what the stream holds (waiting up to block_ms), make the updates it earns and
        publish when due; returns the updates made."""
        entries = await self.dvi.read(self.after, count, block_ms)
        if entries:
            self.after = entries[-1][0]
            records = [r for _, r in entries if r is not None]
            bad = len(entries) - len(records)
            if bad:
                log.warning("DVI: %d malformed replay entries skipped", bad)
            try:
                self.trainer.add(records)
            except ValueError as e:  # records of another drafter shape: skip the batch, say why
                log.error("DVI: replay records refused: %s", e)
                records = []
            self.records.inc(len(records))
            self.debt += self.updates_per_record * len(records)
        loop = asyncio.get_running_loop()
        made = 0
        while self.debt >= 1:
            stats = await loop.run_in_executor(self.executor, self.trainer.step)
            self.debt -= 1
            made += 1
            self.updates.inc()
            self.loss.set(stats["loss"])
            self.reward.set(stats["reward"])
            if self.trainer.steps - self.published >= self.publish_every:
                await self.publish()
        return made

    async def publish(self) -> None:
        lora = self.trainer.snapshot()
        await self.dvi.publish(lora)
        self.published = lora.version
        self.version.set(lora.version)
        if self.checkpoint is not None:
            self._save()
        log.info("DVI: adapter version %d published (%d records seen)", lora.version, self.trainer.seen)

    def _save(self) -> None:
        data = {"trainer": self.trainer.checkpoint(), "after": self.after}
        tmp = self.checkpoint.with_name(self.checkpoint.name + ".tmp")
        buf = io.BytesIO()
        torch.save(data, buf)
        tmp.write_bytes(buf.getvalue())
        os.replace(tmp, self.checkpoint)

    def _restore(self) -> None:
        data = torch.load(io.BytesIO(self.checkpoint.read_bytes()), weights_only=True)
        self.trainer.restore(data["trainer"])
        self.after = data["after"]
        self.published = self.trainer.steps
        log.info("DVI: resumed at update %d from %s", self.trainer.steps, self.checkpoint)


def build_loop(s: TrainerSettings, registry: CollectorRegistry | None = None) -> TrainerLoop:
    if not s.redis_url:
        raise InvalidRequest("redis_url", "the trainer reads the replay stream from Redis; set redis_url")
    from specd.drafters import build_drafter
    from specd.runtime import load_model

    if s.threads:
        torch.set_num_threads(s.threads)
    target = load_model(s.target_model, s.device, s.dtype, s.cache_dir, cuda_graphs="off")  # trains: growing caches
    drafter = build_drafter("early-exit", target, None, s.draft_layers, s.draft_adapter)
    trainer = trainer_for(drafter, TrainerConfig(rank=s.rank, lr=s.lr, batch_size=s.batch_size,
                                                 kl_steps=s.kl_steps))
    return TrainerLoop(trainer, RedisDVI(s.redis_url, drafter.name), s.updates_per_record, s.publish_every,
                       s.checkpoint, registry, drafter.name)


async def serve(s: TrainerSettings) -> None:
    from services.common.metrics import serve_metrics

    loop_ = build_loop(s)
    _, port = serve_metrics(loop_.registry, s.host, s.port)
    print(f"specd trainer learning {loop_.dvi.stream_key} (metrics: http://{s.host}:{port}/metrics)", flush=True)
    stop = asyncio.Event()
    aloop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        aloop.add_signal_handler(sig, stop.set)
    while not stop.is_set():
        try:
            await loop_.run_once()
        except REDIS_ERRORS as e:
            log.warning("DVI: replay stream unavailable (%s); retrying", e)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 2.0)
    if loop_.trainer.steps > loop_.published:
        await loop_.publish()
    await loop_.dvi.close()
