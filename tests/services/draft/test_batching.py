"""The draft service's model drafters draft concurrent sessions' steps in shared forwards (over a
KV pool of the drafter's layers), and each session drafts what it would alone, also after a
stretch with speculation off."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from services.common.batcher import StepBatcher
from services.draft.runner import DraftRunner
from specd.drafters.early_exit import EarlyExitDrafter
from specd.policies import Decision, PolicyParams, StoppingPolicy, build_policy
from specd.speculation.proposer import Commit, Token
from specd.types import SamplingParams

PROMPTS = [[5, 9, 14, 20, 33], [40, 7, 11, 3, 8, 21, 30]]
K = 5


def _alone(drafter, prompt: list[int]) -> list[int]:
    session, seq = drafter.open(), list(prompt)
    try:
        for _ in range(K):
            seq.append(session.next(seq, SamplingParams(), None, False).token)
    finally:
        session.close()
    return seq[len(prompt):]


def test_sessions_draft_in_shared_forwards_what_they_draft_alone(tiny_target):
    drafter = EarlyExitDrafter(replace(tiny_target, forward="lean"), layers=2)
    drafter.use_pool(4, 64)
    want = [_alone(drafter, p) for p in PROMPTS]
    sizes: list[int] = []

    async def main():
        executor = ThreadPoolExecutor(1)
        batcher = StepBatcher(None, executor, 8, lambda batch: sizes.append(batch.sessions), gather=0.0)
        events = [[] for _ in PROMPTS]
        runners = [DraftRunner(drafter.open(), build_policy("constant", {"k": K}, {}), SamplingParams(), p,
                               max_length=64, lookahead=1, send_q=False, executor=executor,
                               publish=out.append, batcher=batcher) for p, out in zip(PROMPTS, events)]
        tasks = [asyncio.create_task(r.run()) for r in runners]
        for _ in range(200):
            if all(sum(isinstance(e, Token) for e in out) == K for out in events):
                break
            await asyncio.sleep(0.01)
        for t in tasks:
            t.cancel()
        batcher.close()
        executor.shutdown()
        for r in runners:
            r.session.close()
        return [[e.token for e in out if isinstance(e, Token)] for out in events]

    got = asyncio.run(main())
    assert got == want
    assert max(sizes) == 2  # the two sessions' steps shared forwards
    assert drafter._kv_pool.in_use() == 0


class OffThenOn(StoppingPolicy):
    """Skips the first `off` rounds (speculation off), then drafts windows of K."""

    name = "off-then-on"

    def __init__(self, off: int):
        super().__init__(PolicyParams())
        self.off = off

    def should_draft(self):
        self.off -= 1
        return self.off < 0

    def decide(self, step):
        return Decision.CONTINUE if step.index < K else Decision.STOP


def test_after_speculation_was_off_the_draft_proposes_what_it_would_have(tiny_target):
    """While a policy does not draft, commits still reach the draft session (its cache catches up
    on the next step), so the first window after re-enabling is the one a session that drafted
    all along would propose after the same text: acceptance does not collapse."""
    drafter = EarlyExitDrafter(replace(tiny_target, forward="lean"), layers=2)
    drafter.use_pool(4, 64)
    prompt, committed = PROMPTS[0], [17, 23, 29, 31]  # the target's plain steps while drafting was off

    async def main():
        executor = ThreadPoolExecutor(1)
        batcher = StepBatcher(None, executor, 8, gather=0.0)
        events: list = []
        runner = DraftRunner(drafter.open(), OffThenOn(len(committed)), SamplingParams(), prompt, max_length=64,
                             lookahead=1, send_q=False, executor=executor, publish=events.append, batcher=batcher)
        task = asyncio.create_task(runner.run())
        for i, token in enumerate(committed, 1):
            await asyncio.sleep(0.01)
            runner.commit(Commit(i, (token,), num_verified=0, num_strict=0))
        for _ in range(200):
            if sum(isinstance(e, Token) for e in events) == K:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        batcher.close()
        executor.shutdown()
        runner.session.close()
        return [e.token for e in events if isinstance(e, Token)]

    assert asyncio.run(main()) == _alone(drafter, prompt + committed)
