"""PEARL in process (Liu et al. 2024, arXiv 2408.11850): the round of
specd.speculation.driver with its `Proposer` on a drafting thread of its own (lookahead 2: the
next window is drafted while this one is verified) while the caller's thread verifies. Only
the transport differs from the sequential round: the proposer's events cross in its queue,
and a lock stands where the draft service has its event loop.

The two threads meet only there. The drafting thread holds the lock while it asks the policy
and updates the proposer, and releases it for the draft model's step (torch releases the
GIL while it computes), so a commit is applied while a step is in flight and the step's
proposal is then dropped as moot, as in the draft service. The draft session's cache is only
touched by the drafting thread (a rollback a commit asks for is applied before the next step).

A drafting thread that fails or stalls never fails the request: the run goes on with the
target alone (`RoundStats.fallback`), as the services do when a draft service dies.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from specd.speculation.driver import RoundDriver, RoundStats
from specd.speculation.sequencer import Chunk

log = logging.getLogger(__name__)

DRAFT_STALL_S = 10.0  # waiting this long on the drafting thread alone: the target alone from here
CLOSE_WAIT_S = 10.0  # at close, the longest wait for a draft step in flight to end


class Overlap(RoundDriver):
    """One request's PEARL rounds, driven by its run (specd.engine.OverlapRun); windows are
    chains, and the policy is one that drafts (not relaxed, the oracle or DVI)."""

    LOOKAHEAD = 2

    def __init__(self, run, stats: RoundStats, stall_s: float | None = None):
        super().__init__(run, stats)
        stats.overlap = True
        self.stall_s = DRAFT_STALL_S if stall_s is None else stall_s
        self.lock = threading.Condition()
        self.thread: threading.Thread | None = None

    # -- the drafting thread ----------------------------------------------------------------
    def start(self) -> None:
        super().start()
        self.thread = threading.Thread(target=self._draft, name="specd-pearl-draft", daemon=True)
        self.thread.start()

    def _draft(self) -> None:
        p = self.proposer
        try:
            while True:
                with self.lock:
                    while not self.closed and (ready := p.prepare()) is None:
                        self.lock.wait()
                    if self.closed:
                        return
                window, epoch, seq = ready
                t0 = time.perf_counter()
                d = p.next(seq)  # the lock released: a commit may land meanwhile
                with self.lock:
                    if self.closed:
                        return
                    p.drafted(window, epoch, seq, d, time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - a draft that fails never fails the request
            self.events.put(e)

    def _notify(self) -> None:
        self.lock.notify_all()

    def close(self) -> bool:
        """Stop the drafting thread (after its step in flight, if any); idempotent. False where
        the step has not ended within CLOSE_WAIT_S: the draft session is still in use then, and
        is left to the thread."""
        with self.lock:
            self.closed = True
            self.lock.notify_all()
        if self.thread is not None:
            self.thread.join(CLOSE_WAIT_S)
            if self.thread.is_alive():
                log.warning("the drafting thread is still in a draft step %.1f s after close", CLOSE_WAIT_S)
                return False
            self.thread = None
        self.stats.drafted_total = self.proposer.num_drafted
        self.stats.draft_time_s = self.proposer.draft_seconds
        return True

    # -- the caller's thread ----------------------------------------------------------------
    def round(self):
        out = super().round()
        self.stats.continuations_kept += self.last.continuation_kept
        return out

    def _next_chunk(self) -> Chunk:
        """What to verify now: the proposer's events so far taken in, then waited for while
        the sequencer has nothing to send (a stalled or failed draft: the target alone)."""
        while True:
            self._take_all()
            chunk = self.rounds.next_chunk()
            if chunk is not None:
                return chunk
            try:
                self._take(self.events.get(timeout=self.stall_s))
            except queue.Empty:
                self._fall_back(f"nothing drafted within {self.stall_s} s", "stalled")
