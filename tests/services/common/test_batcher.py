"""The verification batcher's step scheduling: sessions the last forward answered are waited for
(briefly), so a batch does not split into halves that each run while the other travels; a
session that ended is not waited for. And the decode cost it follows from plain steps."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from services.common.batcher import Job, MultiStep, StepBatcher, judge_windows
from specd.cost_model import smoothed
from specd.types import SamplingParams
from specd.verify import Window, verify_window


@pytest.fixture
def pooled(tiny_target):
    model = replace(tiny_target, forward="lean")
    model.use_pool(4, 64)
    return model


async def _round(batcher, sessions, late=None, delay=0.05):
    """Each session submits one token; `late` submits `delay` seconds after the others."""
    async def one(s):
        if s is late:
            await asyncio.sleep(delay)
        return await batcher.submit(s, [7], 1, lambda logits, hidden: int(logits[-1].argmax()))

    return await asyncio.gather(*(one(s) for s in sessions))


@contextlib.asynccontextmanager
async def _batcher(pooled, gather: float = 0.0, on_batch=None):
    """A batcher on one compute thread and two sessions with a 3-token prefix each."""
    executor = ThreadPoolExecutor(1)
    batcher = StepBatcher(pooled.model, executor, 8, on_batch, gather)
    a, b = pooled.session(), pooled.session()
    for s in (a, b):
        s.extend([3, 4, 5], 1)
    try:
        yield batcher, a, b
    finally:
        batcher.close()
        executor.shutdown()
        a.close()
        b.close()


def _gathered(pooled, gather: float, forget_late: bool = False) -> list:
    """How the forwards of two rounds of two sessions were gathered, the second session coming
    back late in the second round."""
    seen: list = []

    async def main():
        async with _batcher(pooled, gather, seen.append) as (batcher, a, b):
            await _round(batcher, [a, b])  # together: both are expected back
            batcher.last_forward_s = 1.0  # waiting up to gather x 1 s covers the late session
            if forget_late:  # b's request ended instead: a goes on alone at once
                batcher.forget(b)
                await asyncio.wait_for(_round(batcher, [a]), 5.0)
            else:
                await _round(batcher, [a, b], late=b)

    asyncio.run(main())
    return seen


def _run(pooled, gather: float, forget_late: bool = False) -> list[int]:
    """The batch sizes of those forwards."""
    return [g.sessions for g in _gathered(pooled, gather, forget_late)]


def test_a_session_back_a_moment_late_joins_the_forward_of_the_others(pooled):
    assert _run(pooled, gather=0.5) == [2, 2]


def test_without_the_wait_the_late_session_runs_a_forward_of_its_own(pooled):
    """The negative control: the same arrivals with gathering off split the batch."""
    assert _run(pooled, gather=0.0) == [2, 1, 1]


def test_each_forward_reports_its_wait_for_the_last_ones_sessions(pooled):
    """What the target's metrics export (specd_verify_gather_seconds and _missed_total): the
    forward that waited for the late session waited about its delay and missed nobody; without
    the wait, the forward that left it behind missed one session."""
    first, joined = _gathered(pooled, gather=0.5)
    assert first.gather_seconds < 0.04 and first.missed == 0
    assert 0.04 <= joined.gather_seconds < 0.5 and joined.missed == 0
    assert (joined.sessions, joined.tokens) == (2, 2)
    split = _gathered(pooled, gather=0.0)
    assert [g.sessions for g in split] == [2, 1, 1] and split[1].missed == 1
    assert max(g.gather_seconds for g in split) < 0.04


def test_a_session_answered_while_another_queued_is_waited_for_not_left_behind(pooled):
    """b arrives during a's forward; a, answered, comes straight back. With no multi-step run in
    that forward, the worker hands a its result and waits for it rather than starting b's
    forward at once, which would split the two into alternating halves for good."""
    import time

    sizes: list[int] = []

    def slow(logits, hidden):
        time.sleep(0.05)
        return int(logits[-1].argmax())

    async def main():
        async with _batcher(pooled, 0.5, lambda batch: sizes.append(batch.sessions)) as (batcher, a, b):
            async def a_twice():
                await batcher.submit(a, [7], 1, slow)
                await batcher.submit(a, [7], 1, slow)

            async def b_during():
                await asyncio.sleep(0.01)
                await batcher.submit(b, [7], 1, slow)

            await asyncio.gather(a_twice(), b_during())

    asyncio.run(main())
    assert sizes == [1, 2]


def test_a_session_that_ended_is_not_waited_for(pooled):
    assert _run(pooled, gather=1000.0, forget_late=True) == [2, 1]


def test_a_session_whose_step_fails_fails_alone(pooled):
    """One session's verdict raising (bad input found on the compute thread) is that session's
    error; the other session in the same forward gets its answer."""
    def bad(logits, hidden):
        raise ValueError("this session's input")

    async def main():
        async with _batcher(pooled) as (batcher, a, b):
            return await asyncio.gather(batcher.submit(a, [7], 1, lambda logits, hidden: "ok"),
                                        batcher.submit(b, [7], 1, bad), return_exceptions=True)

    good, failed = asyncio.run(main())
    assert good[0] == "ok" and good[1].batch_size == 2
    assert isinstance(failed, ValueError)


def test_jobs_that_bring_windows_get_their_verdicts_judged_together(pooled):
    """Jobs submitted with their windows are handed verdicts, judged for every such job of the
    forward at once (judge_windows), equal to judging each alone; a job without gets (logits,
    hidden) as before, in the same forward."""
    greedy, seeded = Window([5, 9], SamplingParams(temperature=0.0)), Window([3], SamplingParams(0.8, seed=4), position=2)

    def rows(logits, hidden, verdict):
        return verdict, logits.clone()

    async def main():
        async with _batcher(pooled) as (batcher, a, b):
            c = pooled.session()
            try:
                return await asyncio.gather(batcher.submit(a, [7, 5, 9], 3, rows, window=greedy),
                                            batcher.submit(b, [7, 3], 2, rows, window=seeded),
                                            batcher.submit(c, [7], 1, lambda logits, hidden: "plain"))
            finally:
                c.close()

    (one, info), (two, _), (plain, _) = asyncio.run(main())
    assert info.batch_size == 3 and plain == "plain"
    for (verdict, logits), w in ((one, greedy), (two, seeded)):
        assert verdict == verify_window(logits, w.drafts, None, w.sampling, None, position=w.position)


def test_windows_that_cannot_be_judged_together_are_each_judged_alone():
    """judge_windows: None for jobs without windows, and for all where the batch fails (each
    job's own judgement then meets its own error)."""
    job = functools.partial(Job, None, [1], 2, None)
    logits = [torch.randn(2, 16), torch.randn(3, 16)]
    good = Window([3], SamplingParams(temperature=0.0))
    assert judge_windows([job(window=good), job()], logits) == [verify_window(logits[0], [3], None, good.sampling,
                                                                              None), None]
    broken = Window([3, 4], SamplingParams(temperature=1.0), q=torch.ones(1, 16) / 16)  # one q for two drafts
    assert judge_windows([job(window=good), job(window=broken)], logits) == [None, None]


def test_plain_steps_set_and_then_follow_the_decode_cost(pooled):
    """One session and one token is a plain decoding step: the first sets the decode cost, the
    next moves it by the shared smoothing rule; a forward of two sessions is not one."""
    async def main():
        async with _batcher(pooled) as (batcher, a, b):
            costs = []
            (_, first), = await _round(batcher, [a])
            costs.append(batcher.costs.value("decode_cost"))
            (_, second), = await _round(batcher, [a])
            costs.append(batcher.costs.value("decode_cost"))
            (_, shared), _ = await _round(batcher, [a, b])
            costs.append(batcher.costs.value("decode_cost"))
            return first, second, shared, costs

    first, second, shared, (seeded, followed, after) = asyncio.run(main())
    assert seeded == first.forward_seconds
    assert followed == pytest.approx(smoothed(first.forward_seconds, second.forward_seconds))
    assert shared.batch_size == 2 and after == followed


def test_the_batched_cost_surface_times_each_forward_until_its_result_exists(tiny_target, monkeypatch):
    """A GPU forward returns before it has run: the start-up surface (what cost-aware prices a
    window in a shared forward by) must wait for every timed forward's logits, as the cost curve
    does, or it times only the queueing (an H200 read 0.2 ms for 2 sessions beside the curve's
    2.1 ms for one). Every timed forward here settles its result through specd.costs.settle."""
    from services.common import batcher
    from specd.costs import settle

    forwards, settled = [], []
    real_extend = batcher.extend_together

    def counting_extend(*args, **kwargs):
        forwards.append(1)
        return real_extend(*args, **kwargs)

    def counting_settle(logits):
        settled.append(logits.shape)
        settle(logits)

    monkeypatch.setattr(batcher, "extend_together", counting_extend)
    monkeypatch.setattr(batcher, "settle", counting_settle)
    model = replace(tiny_target, forward="lean")
    model.use_pool(4, 128)  # the surface's 64-token context and a 9-token window
    steps, tokens = batcher.measure_batch_surface(model, 4, repeats=1)
    assert len(steps) == len(tokens) == 4 and all(t > 0 for t in steps)
    assert forwards and len(settled) == len(forwards)


def test_a_disturbed_point_of_the_surface_never_makes_further_tokens_free_under_load():
    """A start-up surface measured on the 2-core EPYC while another process ran (ms): its 8-session
    forward read slower than its 16-session one, and the 8 further tokens at 8 sessions no
    slower than none, so cost-aware priced windows at 8 sessions as free, drafted 4-5 tokens a
    session and was 0.59x the target alone at 8 clients. Each point now costs at least what
    fewer sessions did."""
    from services.common import batcher

    ms = 1e-3
    points = [1, 2, 4, 8, 16]
    steps, tokens = batcher.surface_from_points(points, [17.97 * ms, 18.07 * ms, 18.64 * ms, 49.5 * ms, 44.1 * ms],
                                                [0.81 * ms, 1.61 * ms, 1.38 * ms, 0.0, 2.27 * ms], 16)
    assert len(steps) == len(tokens) == 16
    assert all(b >= a for a, b in zip(steps, steps[1:])) and all(b >= a for a, b in zip(tokens, tokens[1:]))
    assert tokens[7] == pytest.approx(1.61 * ms) and tokens[3] == pytest.approx(1.61 * ms)  # not 0 and 1.38
    assert steps[15] == pytest.approx(49.5 * ms) and tokens[15] == pytest.approx(2.27 * ms)
    assert steps[0] == pytest.approx(17.97 * ms) and tokens[0] == pytest.approx(0.81 * ms)  # measured points stay


def test_a_served_forward_is_timed_until_its_verdicts_exist(pooled):
    """Its seconds (the decode cost, the verify-seconds histogram, and the forward the
    coordinator subtracts from a round trip to find its overhead) run to the verdicts: a GPU
    forward returns before it has run and the verdicts wait for it (an H200's served forwards
    of 7 sessions read 0.4-0.6 ms while they cost 3.2 ms). Here a verdict takes 50 ms."""
    import time

    def slow_verdict(logits, hidden):
        time.sleep(0.05)
        return int(logits[-1].argmax())

    async def main():
        async with _batcher(pooled) as (batcher, a, _b):
            _, info = await batcher.submit(a, [7], 1, slow_verdict)
            return info, batcher.costs.value("decode_cost")

    info, decode_cost = asyncio.run(main())
    assert info.forward_seconds >= 0.05 and decode_cost >= 0.05


class _Recorded(asyncio.Queue):
    """A run's results queue that notes each hand-over in a shared event list."""
    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def put_nowait(self, item):
        self.events.append("result" if item is not None else "end")
        super().put_nowait(item)


def _multi_step(pooled, steps: int | None, stop_after: int | None = None) -> tuple[list, list]:
    """One session's multi-step run of `steps` steps (None: endless) through the batcher: the events
    (each forward started, each result handed over, the end) and the tokens read. stop_after:
    the reader stops the run after reading that many results."""
    events: list = []

    async def main():
        async with _batcher(pooled, 0.5, lambda batch: events.append("forward")) as (batcher, a, _b):
            left = steps

            def then(logits, hidden):
                return int(logits[-1].argmax())

            def next_step():
                nonlocal left
                if left is not None:
                    left -= 1
                    if not left:
                        return None
                return [7], then, 1, None

            run = MultiStep(next_step, _Recorded(events))
            batcher.start_run(a, [7], then, run)
            tokens = []
            while (item := await asyncio.wait_for(run.results.get(), 5.0)) is not None:
                tokens.append(item[0])
                if stop_after is not None and len(tokens) == stop_after:
                    run.stop()
            await asyncio.sleep(0.05)  # nothing more runs
            return tokens

    tokens = asyncio.run(main())
    return events, tokens


def test_a_multi_step_runs_next_step_starts_before_its_last_result_is_handed_over(pooled):
    """The worker queues a run's next step itself and starts that forward first, so each
    reply travels while the next forward runs; the last result is followed by the end."""
    events, tokens = _multi_step(pooled, steps=3)
    assert events == ["forward", "forward", "result", "forward", "result", "result", "end"]
    assert len(tokens) == 3


def test_a_stopped_multi_step_run_ends_after_the_step_already_started(pooled):
    """Stopped after its first result (a client that spoke), a run hands over the step that
    was already running and ends; no further forward runs for it."""
    events, tokens = _multi_step(pooled, steps=None, stop_after=1)
    assert events == ["forward", "forward", "result", "result", "end"]
    assert len(tokens) == 2


def test_a_multi_step_run_whose_next_step_fails_gets_the_error_and_the_worker_goes_on(pooled):
    """The error comes after the step that was computed, then the end; other sessions' steps
    still run (the worker does not die with the run)."""
    def then(logits, hidden):
        return int(logits[-1].argmax())

    def next_step():
        raise ValueError("the window would pass the context")

    async def main():
        async with _batcher(pooled) as (batcher, a, b):
            run = MultiStep(next_step)
            batcher.start_run(a, [7], then, run)
            items = [await asyncio.wait_for(run.results.get(), 5.0) for _ in range(3)]
            after = await asyncio.wait_for(batcher.submit(b, [7], 1, then), 5.0)
            return items, after

    (first, error, end), (token, info) = asyncio.run(main())
    assert isinstance(first[0], int) and isinstance(error, ValueError) and end is None
    assert isinstance(token, int) and info.batch_size == 1


def _run_and_traveller(pooled, round_trip: float, rounds: int = 6, forward: float = 0.03,
                       gather: float = 0.5) -> list:
    """Session a in an endless multi-step run and session b travelling: each of its results goes back
    to its coordinator, which sends the next window `round_trip` seconds later. Every verdict
    takes `forward` seconds. How each forward was gathered, until b's `rounds` rounds are done."""
    import time

    seen: list = []

    def then(logits, hidden):
        time.sleep(forward)
        return int(logits[-1].argmax())

    async def main():
        async with _batcher(pooled, gather, seen.append) as (batcher, a, b):
            run = MultiStep(lambda: ([7], then, 1, None))
            batcher.start_run(a, [7], then, run)

            async def drain():
                while await run.results.get() is not None:
                    pass

            reader = asyncio.create_task(drain())
            for _ in range(rounds):
                await batcher.submit(b, [7], 1, then)
                await asyncio.sleep(round_trip)
            run.stop()
            await asyncio.wait_for(reader, 5.0)

    asyncio.run(main())
    return seen


def test_a_traveller_back_well_within_a_forward_is_waited_for_by_the_multi_step_runs(pooled):
    """A CPU's case: the round trip (5 ms) is short beside the forward (30 ms), so the multi-step run
    waits for the traveller, which joins every forward. Before, a forward with as many multi-step runs
    as travellers started at once and the traveller missed every other forward."""
    seen = _run_and_traveller(pooled, round_trip=0.005, gather=4.0)  # a wait long enough for a busy CI
    with_b = [g for g in seen if g.sessions == 2]
    assert len(with_b) >= 5  # b's rounds after the first forward all shared a forward with a
    assert len(seen) <= 7  # a did not run forwards of its own while b travelled
    assert all(g.missed == 0 for g in seen)


def test_a_traveller_slower_than_a_forward_does_not_hold_up_the_multi_step_runs(pooled):
    """The opposite case: the round trip (120 ms) is longer than the forward (30 ms). Once it is
    measured, the multi-step run's next steps start at once rather than waiting for the traveller."""
    seen = _run_and_traveller(pooled, round_trip=0.12, rounds=4)
    later = seen[len(seen) // 2:]
    assert len(seen) >= 10  # a ran on while b travelled
    assert all(g.gather_seconds < 0.01 for g in later)


def test_each_forward_reports_the_time_spent_on_the_multi_step_runs_next_steps(pooled):
    """specd_verify_next_steps_seconds: a multi-step run whose next step takes 30 ms (a target
    drafting its window) shows it on the forwards after the first, which had none before it."""
    import time

    seen: list = []

    def then(logits, hidden):
        return int(logits[-1].argmax())

    def next_step():
        time.sleep(0.03)
        return [7], then, 1, None

    async def main():
        async with _batcher(pooled, 0.0, seen.append) as (batcher, a, b):
            run = MultiStep(next_step)
            batcher.start_run(a, [7], then, run)
            for _ in range(3):
                await asyncio.wait_for(run.results.get(), 5.0)
            run.stop()

    asyncio.run(main())
    assert seen[0].steps_seconds == 0.0
    assert len(seen) >= 3 and all(g.steps_seconds >= 0.03 for g in seen[1:3])
