"""The draft service's side of online learning (DVI, docs/engine.md, "Online learning (DVI)").

Runners hand over the records of every judged window (`log`); a writer task appends them to
the replay stream in Redis in batches, off the drafting path. A watcher task polls the
adapter version the trainer (`specd serve trainer`) publishes and swaps a new adapter into
the drafter on the model's thread, between two draft steps: sessions keep their KV caches
and go on drafting with the new head (the verifier is unchanged, so output stays lossless).
Redis being slow or down costs records (counted as dropped), never a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import Executor

from services.common.replay import RedisDVI
from services.common.state import REDIS_ERRORS
from services.draft.metrics import DraftMetrics
from specd.drafters.base import Drafter
from specd.dvi import Record
from specd.errors import ModelError

log = logging.getLogger(__name__)


class OnlineLearning:
    def __init__(self, dvi: RedisDVI, drafter: Drafter, executor: Executor, metrics: DraftMetrics,
                 poll_s: float = 1.0, queue_max: int = 20_000):
        self.dvi, self.drafter, self.executor, self.metrics = dvi, drafter, executor, metrics
        self.poll_s = poll_s
        self.queue: asyncio.Queue[Record] = asyncio.Queue(queue_max)
        self.tasks: list[asyncio.Task] = []
        self.refused_version = -1  # a published adapter that does not fit: not retried
        self.logged, self.dropped = metrics.dvi_logged, metrics.dvi_dropped

    def log(self, records: list[Record]) -> None:
        for r in records:
            try:
                self.queue.put_nowait(r)
            except asyncio.QueueFull:
                self.dropped.inc()

    async def start(self) -> None:
        self.tasks = [asyncio.create_task(self._write()), asyncio.create_task(self._watch())]

    def stop(self) -> None:
        """Cancel the writer and the watcher (records still queued are not logged)."""
        for t in self.tasks:
            t.cancel()

    async def _write(self) -> None:
        while True:
            batch = [await self.queue.get()]
            while not self.queue.empty() and len(batch) < 512:
                batch.append(self.queue.get_nowait())
            try:
                await self.dvi.add(batch)
                self.logged.inc(len(batch))
            except REDIS_ERRORS as e:
                self.dropped.inc(len(batch))
                log.warning("DVI: %d records not logged (%s)", len(batch), e)
                await asyncio.sleep(self.poll_s)

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            with contextlib.suppress(*REDIS_ERRORS):
                await self.sync(loop)
            await asyncio.sleep(self.poll_s)

    async def sync(self, loop: asyncio.AbstractEventLoop | None = None) -> bool:
        """Swap in the published adapter if it is not the one in use; True when swapped."""
        version = await self.dvi.version()
        if version in (self.drafter.lora_version, self.refused_version):
            return False
        lora = await self.dvi.fetch()
        if lora is None:
            return False
        loop = loop or asyncio.get_running_loop()
        try:  # on the model's thread: between two draft steps, never under one
            await loop.run_in_executor(self.executor, self.drafter.set_lora, lora)
        except ModelError as e:
            self.refused_version = lora.version
            log.error("DVI: adapter version %d refused: %s", lora.version, e)
            return False
        self.metrics.adapter_version.set(lora.version)
        self.metrics.adapter_swaps.inc()
        log.info("DVI: adapter version %d in use", lora.version)
        return True
