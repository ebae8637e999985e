"""PEARL in process (Liu et al. 2024, arXiv 2408.11850): a drafting thread proposes windows
ahead of the committed sequence while the caller's thread verifies, with the same parts the
services use: the draft side's `Proposer` (lookahead 2: the next window is drafted while this
one is verified), the `Sequencer` (what to verify next, what a verdict commits) and the
target side's `Verifier`. Only the transport differs: a queue of the proposer's events, and a
lock where the draft service has its event loop.

The two threads meet only there. The drafting thread holds the lock while it asks the policy
and updates the proposer, and releases it for the draft model's step (torch releases the
GIL while it computes), so a commit is applied while a step is in flight and the step's
proposal is then dropped as moot, as in the draft service. The draft session's cache is only
touched by the drafting thread (a rollback a commit asks for is applied before the next step).

A drafting thread that fails or stalls never fails the request: the run goes on with the
target alone (`OverlapStats.fallback`), as the services do when a draft service dies.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from specd.logprobs import TokenLogprob
from specd.speculation.proposer import Commit, Proposer, Token, WindowEnd
from specd.speculation.sequencer import Chunk, Sequencer
from specd.stats import GenerationStats

log = logging.getLogger(__name__)

DRAFT_STALL_S = 10.0  # waiting this long on the drafting thread alone: the target alone from here
CLOSE_WAIT_S = 10.0  # at close, the longest wait for a draft step in flight to end


@dataclass
class OverlapStats(GenerationStats):
    overlap: bool = True
    fallback: bool = False
    fallback_reason: str = ""
    fallback_kind: str = ""  # "failed" (the drafter raised) or "stalled" (it drafted nothing for stall_s)
    continuations_kept: int = 0  # drafts past a verified chunk that equalled its bonus token
    drafted_total: int = 0  # every token the drafting thread drafted, verified or not

    def to_dict(self) -> dict:
        return {**super().to_dict(), "overlap": self.overlap, "fallback": self.fallback,
                "fallback_reason": self.fallback_reason, "fallback_kind": self.fallback_kind,
                "continuations_kept": self.continuations_kept,
                "drafted_total": self.drafted_total}


class Overlap:
    """One request's PEARL rounds, driven by its run (specd.engine.OverlapRun): `round()` returns
    each verification's committed tokens (cut at EOS or the length), with their log-probabilities
    where asked."""

    def __init__(self, run, stats: OverlapStats, stall_s: float | None = None):
        target, sampling = run.target, run.sampling
        self.run, self.stats = run, stats
        self.stall_s = DRAFT_STALL_S if stall_s is None else stall_s
        self.features = run.feed_features
        self.verifier = run.verifier  # the run's: its cache, grammar and log-probabilities
        self.verifier.features = self.features  # and the committed positions' hidden states for the drafter
        self.send_q = not sampling.greedy and run.drafter.has_distribution
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.proposer = Proposer(run.draft_session, run.policy, sampling, list(run.seq), max_length=run.max_len,
                                 lookahead=2, send_q=self.send_q, publish=self._publish, generator=run.generator)
        self.proposer.vocab_size = target.emitted_vocab
        self.rounds = Sequencer(run.seq, max_length=run.max_len, eos=target.eos_token_ids, overlap=True,
                                drafting=True)
        self.lock = threading.Condition()
        self.closed = False
        self.commit_id = 0
        self.thread: threading.Thread | None = None

    # -- the drafting thread ----------------------------------------------------------------
    def start(self) -> None:
        if self.features:  # the prompt's hidden states go to the drafter with the first commit
            self.verifier.prefill()
        self.thread = threading.Thread(target=self._draft, name="specd-pearl-draft", daemon=True)
        self.thread.start()

    def _publish(self, event) -> None:
        self.events.put(event)

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
    def round(self) -> tuple[list[int], str | None, list[TokenLogprob] | None]:
        """One verification: (the tokens it committed, the finish reason, their log-probabilities)."""
        chunk = self._next_chunk()
        drafts = [t.token for t in chunk.drafts]
        v, stats = self.verifier, self.stats
        q = torch.stack([t.q for t in chunk.drafts]) if self.send_q and drafts and chunk.drafts[0].q is not None \
            else None
        t0 = time.perf_counter()
        start = v.kv.length
        ids = v.window(drafts)
        logits, hidden = v.kv.extend(ids, len(drafts) + 1, self.features)
        judged = v.judge(logits, hidden, drafts, q, None, False, 0, start)
        verify_s = time.perf_counter() - t0
        stats.verify_time_s += verify_s
        costs = self.run.costs
        if costs is not None and len(ids) == len(drafts) + 1:  # not the prefill round
            with self.lock:  # the drafting thread feeds the same cost model
                costs.observe_target(len(ids), verify_s)
        verdict = judged.verdict
        self._take_all()  # what was drafted during the forward: the next window's first draft may be kept
        c = self.rounds.verified(chunk, verdict.num_accepted, verdict.next_token)
        stats.record_round(c.k, c.n, verdict.num_strict, c.n - min(c.n, verdict.num_strict),
                           [t.entropy for t in chunk.drafts])
        stats.continuations_kept += c.continuation_kept
        if c.notify and not stats.fallback:
            self.commit_id += 1
            with self.lock:
                self.proposer.commit(Commit(self.commit_id, tuple(c.tokens), c.k, verdict.num_strict,
                                            verdict.js_distances, features=judged.features))
                self.lock.notify_all()
        return c.emitted, c.finish_reason, judged.emitted if self.run.top_logprobs is not None else None

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

    def _take_all(self) -> None:
        while True:
            try:
                self._take(self.events.get_nowait())
            except queue.Empty:
                return

    def _take(self, event) -> None:
        if isinstance(event, Token):
            self.rounds.proposed(event)
        elif isinstance(event, WindowEnd):
            self.rounds.window_ended(event, event.relaxed_threshold)
        elif isinstance(event, Exception):
            self._fall_back(f"the drafter failed: {type(event).__name__}: {event}", "failed")
        else:  # an Ack
            self.rounds.acknowledged(event.epoch)

    def _fall_back(self, reason: str, kind: str) -> None:
        s = self.stats
        s.fallback, s.fallback_reason, s.fallback_kind = True, reason, kind
        self.rounds.stop_drafting()
        with self.lock:
            self.closed = True  # the drafting thread stops after its step in flight
            self.lock.notify_all()
