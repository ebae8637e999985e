"""One drafting session of the draft service: a `Proposer` (specd.speculation.proposer, the
draft side of the round) moved by a task on the event loop.

The model runs in a worker thread, or in forwards shared with other sessions (a StepBatcher),
or inline for a lookup; everything else runs on the event loop, so a commit is applied (and
acknowledged) even while a forward pass is in flight.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor

from services.common.batcher import StepBatcher
from specd.drafters.base import DraftSession
from specd.dvi import Record
from specd.policies import StoppingPolicy
from specd.speculation.proposer import Commit, Proposer
from specd.tree import TreePlanner
from specd.types import SamplingParams


class DraftRunner(Proposer):
    def __init__(self, session: DraftSession, policy: StoppingPolicy, sampling: SamplingParams,
                 prompt: list[int], *, max_length: int, lookahead: int, send_q: bool,
                 executor: Executor, publish: Callable[[object], None],
                 on_step: Callable[[float], None] | None = None,
                 log_records: Callable[[list[Record]], None] | None = None,
                 adapter_version: Callable[[], int] = lambda: 0, batcher: StepBatcher | None = None,
                 load_caps: tuple[tuple[int, int], ...] = (), trees: TreePlanner | None = None,
                 t_target: Callable[[float], float] | None = None):
        """batcher: runs this session's draft steps in forwards shared with other sessions, where
        the session can (a model drafter over a KV pool); otherwise each step runs alone.
        on_step: takes each draft step's seconds. The rest: Proposer's."""
        super().__init__(session, policy, sampling, prompt, max_length=max_length, lookahead=lookahead,
                         send_q=send_q, publish=publish, log_records=log_records,
                         adapter_version=adapter_version, load_caps=load_caps, trees=trees, t_target=t_target)
        self.executor, self.on_step, self.batcher = executor, on_step, batcher
        self.wake = asyncio.Event()

    async def run(self) -> None:
        """Draft until cancelled, waiting on commits where the proposer says so."""
        loop = asyncio.get_running_loop()
        while True:
            ready = self.prepare()
            if ready is None:
                self.wake.clear()
                await self.wake.wait()
                continue
            window, epoch, seq = ready
            t0 = time.perf_counter()
            step = None
            if self.batcher is not None:  # a step that can share a forward with other sessions'
                step = self.session.batch_step(seq, self.sampling, self.generator, self.want_hidden)
            if step is not None:
                d, _ = await self.batcher.submit(step.kv, step.ids, 1, step.finish, self.want_hidden)
            elif self.session.inline:  # a lookup: a thread hop (and the GIL's handover) would cost more
                d = self.next(seq)
            else:
                d = await loop.run_in_executor(self.executor, self.next, seq)
            seconds = time.perf_counter() - t0
            if self.on_step is not None:
                self.on_step(seconds)
            self.drafted(window, epoch, seq, d, seconds)

    def commit(self, c: Commit) -> None:
        super().commit(c)
        self.wake.set()
