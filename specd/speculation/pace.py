"""The one clock of a request's measured pace (StoppingPolicy.observe_pace), used by every
driver of the round: the engine, the draft service's runner, and drafting on the target.

A round is timed from the later of the previous commit and the round's own start to its
commit. A driver that drafts between commits (the draft service, where drafting never waits
for the caller) marks no start, so its rounds run commit to commit; one whose rounds start
when the caller asks for them (the engine, a generator its consumer pauses) marks each start,
so the consumer's time between rounds is not counted; drafting on the target marks a start
at each window and commits at the next one, so a round runs start to start. The first commit
is never timed: it also waited for the prompt's prefill.
"""

from __future__ import annotations

import time

from specd.policies.base import StoppingPolicy


class PaceClock:
    def __init__(self, policy: StoppingPolicy | None, clock=None):
        """clock: seconds now (default: time.perf_counter, looked up at each call)."""
        self.policy, self._clock = policy, clock
        self.last_commit: float | None = None
        self.started: float | None = None  # the current round's start, where the driver marks one

    def clock(self) -> float:
        return self._clock() if self._clock is not None else time.perf_counter()

    def start(self) -> None:
        """A round starts now (drafters that only draft when asked)."""
        if self.policy is not None:  # the target alone has nothing to time: no clock read a round
            self.started = self.clock()

    def commit(self, tokens: int, drafted: bool, timed: bool = True) -> None:
        """A round committed `tokens` now; drafted: whether the drafter ran for it. timed False:
        the round is not observed (its time is not the pace, e.g. a stretch's first plain round
        that paid a round trip the others skip), but the next one is timed from here."""
        if self.policy is None:
            return
        now = self.clock()
        if self.last_commit is not None and timed:
            since = self.last_commit if self.started is None else max(self.last_commit, self.started)
            self.policy.observe_pace(tokens, now - since, drafted)
        self.last_commit = now
