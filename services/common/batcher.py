"""Steps of concurrent sessions in one forward pass: the target's verifications, and the draft
service's draft steps of model drafters.

Sessions submit jobs (new ids after their cache, how many logits they need); one worker
takes every job queued while the previous forward ran and runs them as one batch. A session
answered by a forward comes back one round trip later (its coordinator commits the verdict and
sends the next window), so before the next forward the worker waits a moment for the sessions of
the last one, at most `gather` times that forward's duration: without the wait, sessions that
arrive a millisecond late start a second forward and the batch splits in two for good (each
half then runs while the other half travels). A lone session is never kept waiting, since the
worker only waits for sessions it has answered and that have not come back yet.

A multi-step run (a session's decoding steps with no round trip between them, `MultiStep`) needs no
wait: after each forward the worker queues the run's next step itself. Whether its next step
waits for the travelling sessions (those that went back to their coordinator) is a trade of
session time: waiting costs each multi-step run the travellers' round trip, not waiting costs each
traveller a whole forward (it joins the one after). The worker follows the round trip it
measures (hand-over to the last traveller's return) and starts the next forward at once, before
it hands over the last one's results, only where the multi-step runs lose more by waiting:
round trip x multi-step runs > forward x travellers. On a CPU a forward lasts several round trips,
so travellers are waited for unless the runs outnumber them as many times over; where a round
trip is as long as a forward (a GPU under load), the runs go on as soon as they outnumber the
travellers, whose replies travel while the next forward runs (docs/engine.md, "Multi-step runs in
the step scheduler").

Sessions in a KV pool (specd.runtime.pool) run as one pooled forward that reads and writes their
slots in place; other sessions are copied into a padded batch cache
(specd.runtime.batch.batched_extend_hidden).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np
import torch

from specd.cost_model import TARGET, CostModel
from specd.costs import median_time, settle, synthetic_prefix
from specd.errors import Overloaded
from specd.runtime.batch import batched_extend_hidden
from specd.runtime.pool import PoolSession, pooled_extend
from specd.runtime.session import KVSession
from specd.tree import DraftTree
from specd.verify import Verdict, Window, verify_windows

log = logging.getLogger(__name__)


@dataclass
class Job:
    session: KVSession | PoolSession
    ids: list[int]
    num_logits: int
    then: Callable[[torch.Tensor, torch.Tensor | None], object]  # on the compute thread: (logits, hidden)
    future: asyncio.Future = field(default=None)
    want_hidden: bool = False
    queued_at: float = 0.0
    tree: DraftTree | None = None  # ids end with this draft tree's nodes (specd.tree)
    run: MultiStep | None = None  # a multi-step run's step: its result goes to run.results, not future
    window: Window | None = None  # then(logits, hidden, verdict): judged with the forward's others (verify_windows)


@dataclass(eq=False)
class MultiStep:
    """A session's decoding steps that follow each other with no round trip (the target alone, and
    its rounds where it drafts itself). After each step's forward the worker asks
    `next_step` for the next one ((ids, then, logits rows, window or None), or None: the run
    ends) and queues it at once; each step's (result, BatchInfo), or its error, goes to
    `results` in order, and None after the last. `stop()` ends it after the steps
    already started (at most one more result, then None)."""
    next_step: Callable[[], tuple[list[int], Callable[..., object], int, Window | None] | None]
    results: asyncio.Queue = field(default_factory=asyncio.Queue)
    stopped: bool = False
    error: Exception | None = None  # next_step raised: the run's last result, before None

    def stop(self) -> None:
        self.stopped = True


@dataclass(frozen=True)
class Gathered:
    """How one forward's batch was gathered (what `on_batch` is told before it runs)."""
    sessions: int
    tokens: int  # new tokens of every session in it
    waits: list[float]  # seconds each of its jobs waited in the queue
    gather_seconds: float = 0.0  # of which the worker spent waiting for the last forward's sessions
    missed: int = 0  # sessions of the last forward not back when it started (the wait ran out)
    steps_seconds: float = 0.0  # the worker spent between the last forward and this one on multi-step runs'
    # next steps (a target drafting for its sessions drafts there: services.target.drafting)


@dataclass(frozen=True)
class BatchInfo:
    forward_seconds: float
    batch_size: int
    batch_tokens: int = 0  # new tokens of every session in the forward
    emitted: int = 0  # tokens its verdicts emitted, where the batcher counts them (StepBatcher.emitted_of)


def extend_together(model: torch.nn.Module, sessions: list, ids: list[list[int]], num_logits: list[int],
                    want_hidden: list[bool],
                    trees: list[DraftTree | None] | None = None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """One forward over every session: in place over the KV pool, else over a padded copy (where
    a session's draft tree runs in a forward of its own)."""
    if all(isinstance(s, PoolSession) for s in sessions):
        return pooled_extend(sessions, ids, num_logits, want_hidden, trees)
    trees = trees or [None] * len(sessions)
    out: list = [None] * len(sessions)
    for i, tree in enumerate(trees):
        if tree is not None:
            pending = ids[i][:len(ids[i]) - len(tree)]
            out[i] = sessions[i].extend_tree(pending, tree, next(model.parameters()).dtype), None
    chains = [i for i, tree in enumerate(trees) if tree is None]
    if chains:
        done = batched_extend_hidden(model, [sessions[i] for i in chains], [ids[i] for i in chains],
                                     [num_logits[i] for i in chains], [want_hidden[i] for i in chains])
        for i, r in zip(chains, done):
            out[i] = r
    return out


def judge_windows(jobs: list[Job], logits: list[torch.Tensor]) -> list[Verdict | None]:
    """The verdicts of a forward's jobs that bring their windows, judged together (on a GPU one
    read from the device for all: specd.verify.verify_windows); None for the others, and for
    every job where that fails (each then judges its own and meets its own error)."""
    at = [i for i, j in enumerate(jobs) if j.window is not None]
    out: list[Verdict | None] = [None] * len(jobs)
    try:
        for i, verdict in zip(at, verify_windows([logits[i] for i in at], [jobs[i].window for i in at])):
            out[i] = verdict
    except Exception:  # noqa: BLE001 - judged one by one instead, each meeting its own error
        log.warning("a forward's windows could not be judged together; judging them one by one", exc_info=True)
        return [None] * len(jobs)
    return out


def measure_batch_surface(target, max_batch: int, repeats: int = 3) -> tuple[list[float], list[float]]:
    """The batched cost surface at start-up: for B = 1..max_batch sessions after a 64-token
    context each, the median seconds of a forward of one new token per session, and what each
    further token adds (one session's 9-token window in the same forward). Measured at B = 1, 2,
    4, 8, ... and max_batch, interpolated between."""
    prefix = synthetic_prefix(target.vocab_size)
    sessions = []
    try:
        for _ in range(max_batch):
            s = target.session()
            sessions.append(s)
            s.extend(prefix, 1)
    except Overloaded:  # fewer KV slots than sessions per forward: measure what fits
        pass
    try:
        points = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < len(sessions)} | {len(sessions)})
        steps, tokens = [], []
        for b in points:
            group = sessions[:b]

            def forward(extra: int, group=group, b=b):
                out = extend_together(target.model, group, [[7] * (1 + extra)] + [[7]] * (b - 1), [1] * b,
                                      [False] * b)
                settle(out[-1][0])
                for s in group:
                    s.rollback(len(prefix))

            forward(0), forward(8)  # warm-up
            one = median_time(lambda: forward(0), repeats)
            steps.append(one)
            tokens.append(max(median_time(lambda: forward(8), repeats) - one, 0.0) / 8)
    finally:
        for s in sessions:
            s.close()
    return surface_from_points(points, steps, tokens, max(len(sessions), 1))


def surface_from_points(points: list[int], steps: list[float], tokens: list[float],
                        sessions: int) -> tuple[list[float], list[float]]:
    """The surface for 1..sessions from its measured points: a forward of one token a session,
    and each further token, never cheaper for more sessions (a forward that carries more
    tokens is no faster, and its further tokens are no cheaper), so a point that another
    process slowed or sped up cannot make further tokens look free under load; interpolated
    between the points."""
    steps, tokens = np.maximum.accumulate(steps), np.maximum.accumulate(tokens)
    every = range(1, sessions + 1)
    return [float(t) for t in np.interp(every, points, steps)], [float(t) for t in np.interp(every, points, tokens)]


class StepBatcher:
    def __init__(self, model: torch.nn.Module, executor: Executor, max_batch_size: int = 8,
                 on_batch: Callable[[Gathered], None] | None = None, gather: float = 0.5,
                 costs: CostModel | None = None):
        """costs: the process's cost model, where it follows decode_cost and round_trip (None: a
        target's of its own)."""
        self.model, self.executor, self.max_batch_size = model, executor, max_batch_size
        self.costs = costs or CostModel(TARGET)
        self.on_batch = on_batch  # called with how each forward was gathered, before it runs
        self.gather = gather  # wait for returning sessions up to this fraction of the last forward
        self.queue: list[Job] = []
        self.arrived = asyncio.Event()
        self.last_batch_size = 0
        self.last_forward_s = 0.0
        self.away: dict = {}  # travelling session -> when its result was handed over
        self.handed_at = 0.0  # the last hand-over's
        self._stopped: list[MultiStep] = []  # runs whose queued step _take left out
        self.on_forward: Callable[[BatchInfo], None] | None = None  # told each forward's cost, after it
        self.emitted_of: Callable[[object], int] | None = None  # the tokens one job's result emitted
        self._worker: asyncio.Task | None = None

    async def submit(self, session: KVSession | PoolSession, ids: list[int], num_logits: int,
                     then: Callable[..., object], want_hidden: bool = False, tree: DraftTree | None = None,
                     window: Window | None = None) -> tuple[object, BatchInfo]:
        """Extend session by ids in the next forward; returns then(logits, hidden) and the
        batch's info (hidden: the last hidden states of the same positions, if wanted). With a
        draft tree, ids end with its nodes and num_logits is len(tree) + 1. window: the window
        the logits judge, judged with every other of the forward (judge_windows); then gets a
        third argument, its verdict (None: judge it alone)."""
        job = Job(session, ids, num_logits, then, asyncio.get_running_loop().create_future(), want_hidden,
                  time.perf_counter(), tree, window=window)
        self._enqueue(job)
        return await job.future

    def start_run(self, session: KVSession | PoolSession, ids: list[int], then: Callable[..., object],
                  run: MultiStep, want_hidden: bool = False, window: Window | None = None, num_logits: int = 1) -> None:
        """Queue a multi-step run's first step (ids: the session's uncached tokens, then any drafts;
        num_logits: the rows its verdict reads; window: as submit's); its results, and those of
        the steps run.next_step gives ((ids, then, rows, window)), arrive in run.results."""
        self._enqueue(Job(session, ids, num_logits, then, None, want_hidden, time.perf_counter(), run=run,
                          window=window))

    def _enqueue(self, job: Job) -> None:
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._run())
        handed = self.away.pop(job.session, None)
        if handed is not None and handed not in self.away.values():  # the last of its hand-over back
            self.costs.observe("round_trip", time.perf_counter() - handed)
        self.queue.append(job)
        self.arrived.set()

    def forget(self, session: KVSession | PoolSession) -> None:
        """The session ended: the worker no longer waits for it."""
        self.away.pop(session, None)
        self.arrived.set()

    @property
    def returning(self) -> set:
        """The sessions the last forward answered that have not come back yet."""
        return {s for s, handed in self.away.items() if handed == self.handed_at}

    async def _gather(self) -> tuple[list[Job], float, int]:
        """The next forward's jobs: every queued one, after waiting (at most `gather` times the
        last forward) for the sessions the last forward answered; with the seconds waited for
        them and how many had not come back."""
        while not self.queue:
            self.arrived.clear()
            await self.arrived.wait()
        start = time.perf_counter()
        deadline = start + self.gather * self.last_forward_s
        while self.returning and len(self.queue) < self.max_batch_size:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), left)
            except TimeoutError:
                break
        return self._take(), time.perf_counter() - start, len(self.returning)

    def _take(self) -> list[Job]:
        """Up to a batch of queued jobs, leaving out those nobody waits for any more (the client
        went away, or its multi-step run stopped: _end_stopped tells it)."""
        jobs, self.queue = self.queue[:self.max_batch_size], self.queue[self.max_batch_size:]
        live = []
        for j in jobs:
            if j.run is not None and j.run.stopped:
                self._stopped.append(j.run)
            elif j.run is not None or not j.future.cancelled():
                live.append(j)
        return live

    def _end_stopped(self) -> None:
        """None to each stopped run whose queued step was left out, after its last results."""
        for run in self._stopped:
            run.results.put_nowait(None)
        self._stopped.clear()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        last: tuple | None = None  # the last forward's jobs, results and going runs, not handed over yet
        at_once = False  # start the next forward before handing over the last one's results
        steps_s = 0.0  # spent on the last forward's multi-step runs' next steps
        while True:
            if last is not None and at_once and self.queue:
                jobs, waited, missed = self._take(), 0.0, len(self.returning)
            else:
                if last is not None:
                    self._hand_over(*last)
                    last = None
                jobs, waited, missed = await self._gather()
            forward = None
            if jobs:
                self.last_batch_size = len(jobs)
                t0 = time.perf_counter()
                if self.on_batch is not None:
                    self.on_batch(Gathered(len(jobs), sum(len(j.ids) for j in jobs),
                                           [t0 - j.queued_at for j in jobs], waited, missed, steps_s))
                steps_s = 0.0
                forward = loop.run_in_executor(self.executor, self._forward, jobs)
            if last is not None:  # the last forward's results travel while this one runs
                self._hand_over(*last)
                last = None
            self._end_stopped()
            if forward is None:
                continue
            try:
                results = await forward
            except Exception as e:  # noqa: BLE001 - every waiting session gets the error
                results = [e] * len(jobs)
            finally:
                self.last_forward_s = time.perf_counter() - t0
            if self.on_forward is not None:
                info = next((r[1] for r in results if not isinstance(r, BaseException)), None)
                if info is not None:
                    self.on_forward(info)
            t_steps = time.perf_counter()
            going = self._queue_next_steps(jobs, results)
            steps_s += time.perf_counter() - t_steps
            last = jobs, results, going
            at_once = self._at_once(len(going), len(self._travellers(jobs, going)))

    def _at_once(self, runs: int, travelling: int) -> bool:
        """Whether the next forward starts at once with the multi-step runs' next steps, leaving the
        travellers for the one after: where waiting for them (the measured round trip, for each
        run) would cost more session time than a forward each costs them. Until a round trip
        has been measured, they are waited for (the wait is bounded by `gather`)."""
        if not runs:
            return False
        return not travelling or self.costs.value("round_trip") * runs > self.last_forward_s * travelling

    @staticmethod
    def _travellers(jobs: list[Job], going: set[int]) -> list:
        """The sessions of a forward that go back to their coordinator: verifications, and
        multi-step runs that ended."""
        return [j.session for j in jobs if (j.run is not None and id(j.run) not in going)
                or (j.run is None and not j.future.done())]

    def _queue_next_steps(self, jobs: list[Job], results: list) -> set[int]:
        """Queue the next step of each multi-step run whose step succeeded and that goes on; the
        ids of the runs that go on."""
        going = set()
        for j, r in zip(jobs, results):
            if j.run is None or j.run.stopped or isinstance(r, BaseException):
                continue
            try:
                step = j.run.next_step()
            except Exception as e:  # noqa: BLE001 - the run's error, after this step's result
                j.run.error, step = e, None
            if step is not None:
                ids, then, num_logits, window = step
                self.queue.append(Job(j.session, ids, num_logits, then, None, j.want_hidden, time.perf_counter(),
                                      run=j.run, window=window))
                going.add(id(j.run))
        return going

    def _hand_over(self, jobs: list[Job], results: list, going: set[int]) -> None:
        """Each job's result to its waiter (a multi-step run's last step: then None); the sessions
        that now travel are waited for."""
        self.handed_at = time.perf_counter()
        self.away.update((s, self.handed_at) for s in self._travellers(jobs, going))
        for j, r in zip(jobs, results):
            if j.run is not None:
                j.run.results.put_nowait(r)
                if id(j.run) not in going:
                    if j.run.error is not None:
                        j.run.results.put_nowait(j.run.error)
                    j.run.results.put_nowait(None)
            elif not j.future.done():
                if isinstance(r, BaseException):
                    j.future.set_exception(r)
                else:
                    j.future.set_result(r)

    def _forward(self, jobs: list[Job]) -> list[tuple[object, BatchInfo]]:
        t0 = time.perf_counter()
        out = extend_together(self.model, [j.session for j in jobs], [j.ids for j in jobs],
                              [j.num_logits for j in jobs], [j.want_hidden for j in jobs], [j.tree for j in jobs])
        # Timed to the verdicts: a GPU forward returns before it has run, and they wait for it.
        verdicts = judge_windows(jobs, [lg for lg, _ in out])
        judged = [self._judge(j, lg, h, v) for j, (lg, h), v in zip(jobs, out, verdicts)]
        emitted = sum(self.emitted_of(r) for r in judged if not isinstance(r, Exception)) if self.emitted_of else 0
        info = BatchInfo(time.perf_counter() - t0, len(jobs), sum(len(j.ids) for j in jobs), emitted)
        if len(jobs) == 1 and len(jobs[0].ids) == 1:
            self.costs.observe("decode_cost", info.forward_seconds)  # one plain decoding step
        return [r if isinstance(r, Exception) else (r, info) for r in judged]

    @staticmethod
    def _judge(job: Job, logits: torch.Tensor, hidden: torch.Tensor | None, verdict: Verdict | None) -> object:
        """One job's result, or the error its own `then` raised: that session fails alone, the
        others in the forward get their answers."""
        try:
            return job.then(logits, hidden, verdict) if job.window is not None else job.then(logits, hidden)
        except Exception as e:  # noqa: BLE001 - handed to that job's waiter
            return e

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
