"""Verification of concurrent sessions in one forward pass.

Sessions submit jobs (new ids after their cache, how many logits they need); one worker
takes every job queued while the previous forward ran and runs them as one batch, so batching
costs no added latency: a lone request is run at once, and requests arriving during a forward
share the next one. Sessions in the target's KV pool (specd.models.pool) run as one pooled
forward that reads and writes their slots in place; other sessions are copied into a padded
batch cache (specd.models.batch.batched_extend_hidden).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import torch

from specd.models.batch import batched_extend_hidden
from specd.models.pool import PoolSession, pooled_extend
from specd.models.session import KVSession


@dataclass
class Job:
    session: KVSession | PoolSession
    ids: list[int]
    num_logits: int
    then: Callable[[torch.Tensor, torch.Tensor | None], object]  # on the compute thread: (logits, hidden)
    future: asyncio.Future = field(default=None)
    want_hidden: bool = False


@dataclass(frozen=True)
class BatchInfo:
    forward_seconds: float
    batch_size: int


class DecodeCost:
    """The seconds of one plain decoding step (one session, one new token): an exponential
    moving average over such forwards while serving, seeded by a start-up measurement."""

    def __init__(self, seconds: float = 0.0, alpha: float = 0.1):
        self.seconds, self.alpha = seconds, alpha

    def observe(self, seconds: float) -> None:
        self.seconds = seconds if self.seconds <= 0 else self.seconds + self.alpha * (seconds - self.seconds)


class VerifyBatcher:
    def __init__(self, model: torch.nn.Module, executor: Executor, max_batch_size: int = 8,
                 on_batch: Callable[[int], None] | None = None):
        self.model, self.executor, self.max_batch_size = model, executor, max_batch_size
        self.on_batch = on_batch  # called with each forward's batch size
        self.queue: asyncio.Queue[Job] = asyncio.Queue()
        self.last_batch_size = 0
        self.decode_cost = DecodeCost()
        self._worker: asyncio.Task | None = None

    async def submit(self, session: KVSession | PoolSession, ids: list[int], num_logits: int,
                     then: Callable[[torch.Tensor, torch.Tensor | None], object],
                     want_hidden: bool = False) -> tuple[object, BatchInfo]:
        """Extend session by ids in the next forward; returns then(logits, hidden) and the
        batch's info (hidden: the last hidden states of the same positions, if wanted)."""
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._run())
        job = Job(session, ids, num_logits, then, asyncio.get_running_loop().create_future(), want_hidden)
        self.queue.put_nowait(job)
        return await job.future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            jobs = [await self.queue.get()]
            while len(jobs) < self.max_batch_size and not self.queue.empty():
                jobs.append(self.queue.get_nowait())
            jobs = [j for j in jobs if not j.future.cancelled()]  # the client went away
            if not jobs:
                continue
            self.last_batch_size = len(jobs)
            if self.on_batch is not None:
                self.on_batch(len(jobs))
            try:
                results = await loop.run_in_executor(self.executor, self._forward, jobs)
            except Exception as e:  # noqa: BLE001 - every waiting session gets the error
                for j in jobs:
                    if not j.future.done():
                        j.future.set_exception(e)
                continue
            for j, r in zip(jobs, results):
                if not j.future.done():
                    j.future.set_result(r)

    def _forward(self, jobs: list[Job]) -> list[tuple[object, BatchInfo]]:
        t0 = time.perf_counter()
        sessions = [j.session for j in jobs]
        args = ([j.ids for j in jobs], [j.num_logits for j in jobs], [j.want_hidden for j in jobs])
        if all(isinstance(s, PoolSession) for s in sessions):  # one forward over the pool, in place
            out = pooled_extend(sessions, *args)
        else:
            out = batched_extend_hidden(self.model, sessions, *args)
        info = BatchInfo(time.perf_counter() - t0, len(jobs))
        if len(jobs) == 1 and len(jobs[0].ids) == 1:
            self.decode_cost.observe(info.forward_seconds)
        return [(j.then(lg, h), info) for j, (lg, h) in zip(jobs, out)]

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
