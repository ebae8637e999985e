"""One request's rounds in process, sequenced by the same three parts the services move: the
draft side's `Proposer` (windows under the stopping policy, epochs, rollbacks, the policy's
feedback, trees, DVI records), the `Sequencer` (what to verify next, what a verdict commits)
and the target side's `Verifier` (the window judged, the verdict committed to its cache).
Only the transport differs: the proposer's events go into a queue that the round reads.

`RoundDriver` is sequential speculative decoding: the proposer drafts a window on the caller's
thread (lookahead 1), the window is verified, its verdict committed to both sides, and the
round returns what it emitted. With no drafter (policy "none") every chunk is empty: a plain
decoding step. `specd.speculation.overlap.Overlap` is the same round with the drafting on a
thread of its own (PEARL).

A drafter that raises never fails the request: the run goes on with the target alone
(`RoundStats.fallback`), as the services do when a draft service dies.

What the grammar forces next (structured output) is verified as drafts with no drafter call
and no policy, as drafting on the target does; a long prefill verifies a chain, not a tree
(its forward keeps the plain causal mask).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from specd.dvi import TOP_K
from specd.logprobs import TokenLogprob
from specd.speculation.proposer import Commit, Proposer, Token, WindowEnd
from specd.speculation.sequencer import Chunk, Committed, Sequencer
from specd.stats import GenerationStats
from specd.tree import TREE_MAX_FED

log = logging.getLogger(__name__)


@dataclass
class RoundStats(GenerationStats):
    """A request's statistics in process, with the keys the services' have besides."""
    overlap: bool = False  # PEARL (specd.speculation.overlap)
    fallback: bool = False  # the target finished alone
    fallback_reason: str = ""
    fallback_kind: str = ""  # "failed" (the drafter raised) or "stalled" (PEARL: it drafted nothing for stall_s)
    continuations_kept: int = 0  # PEARL: drafts past a verified chunk that equalled its bonus token
    drafted_total: int = 0  # every token drafted, verified or not

    def to_dict(self) -> dict:
        return {**super().to_dict(), "overlap": self.overlap, "fallback": self.fallback,
                "fallback_reason": self.fallback_reason, "fallback_kind": self.fallback_kind,
                "continuations_kept": self.continuations_kept, "drafted_total": self.drafted_total}


class RoundDriver:
    """`round()` returns each verification's committed tokens (cut at EOS or the length), the
    finish reason, and the tokens' log-probabilities where asked. `run` is the request
    (specd.engine.GenerationRun): its target, sampling, policy, draft session, verifier and
    costs."""

    LOOKAHEAD = 1  # windows drafted ahead of the committed sequence

    def __init__(self, run, stats: RoundStats):
        target, sampling = run.target, run.sampling
        self.run, self.stats = run, stats
        self.features = run.feed_features
        self.verifier = run.verifier  # the run's: its cache, grammar and log-probabilities
        self.verifier.features = self.features  # and the committed positions' hidden states for the drafter
        self.relaxed = run.spec.relaxed
        self.grammar = run.grammar
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.lock: threading.Condition | nullcontext = nullcontext()  # Overlap's drafting thread shares the proposer
        drafting = run.policy is not None
        self.send_q = drafting and run.drafter.has_distribution and (self.relaxed or not sampling.greedy)
        self.top_k = TOP_K if run.replay is not None else 0  # DVI: the target's top log-probs of judged drafts
        self.proposer: Proposer | None = None
        if drafting:
            replay, drafter = run.replay, run.drafter
            self.proposer = Proposer(
                run.draft_session, run.policy, sampling, list(run.seq), max_length=run.max_len,
                lookahead=self.LOOKAHEAD, send_q=self.send_q, publish=self.events.put,
                log_records=replay.add if replay is not None else None,
                adapter_version=lambda: drafter.lora_version, trees=run.trees,
                t_target=lambda n: run.tree_costs().t_monotone(n), generator=run.generator, round_trip=False)
            self.proposer.vocab_size = target.emitted_vocab
        self.rounds = Sequencer(run.seq, max_length=run.max_len, eos=target.eos_token_ids,
                                overlap=self.LOOKAHEAD > 1, drafting=drafting)
        self.started = self.closed = False
        self.commit_id = 0
        self.last: Committed | None = None  # what the last verdict committed

    def start(self) -> None:
        """Before the first round: the prompt's hidden states, for a drafter on the target's
        features, go to it with the first commit."""
        self.started = True
        if self.features:
            self.verifier.prefill()

    def close(self) -> bool:
        """Stop drafting; True once nothing uses the draft session any more."""
        self.closed = True
        return True

    # -- one round -----------------------------------------------------------------------------
    def round(self) -> tuple[list[int], str | None, list[TokenLogprob] | None]:
        if not self.started:
            self.start()
        if self.proposer is not None and self.LOOKAHEAD == 1:
            self.proposer.pace.start()  # rounds start when the caller asks: its time between them is not the pace
        chunk, forced = self._forced(), True
        if chunk is None:
            chunk, forced = self._next_chunk(), False
        if self.proposer is not None:
            self.stats.draft_time_s = self.proposer.draft_seconds
            self.stats.drafted_total = self.proposer.num_drafted
        drafts = [t.token for t in chunk.drafts]
        v, stats, k = self.verifier, self.stats, len(drafts)
        q = torch.stack([t.q for t in chunk.drafts]) if self.send_q and drafts and chunk.drafts[0].q is not None \
            else None
        entropies = [] if forced else [t.entropy for t in chunk.drafts]
        t0 = time.perf_counter()
        start, committed = v.kv.length, len(v.seq)
        tree = v.tree(drafts, list(chunk.side_tokens), list(chunk.side_parents), False, 0) \
            if chunk.side_tokens and committed - start <= TREE_MAX_FED else None
        if tree is not None:
            logits = v.kv.extend_tree(v.seq[start:], tree, next(self.run.target.model.parameters()).dtype)
            judged = v.judge_tree(logits, tree, q)
            fed, prefill = len(tree) + 1, start != committed - 1
        else:
            ids = v.window(drafts)
            logits, hidden = v.kv.extend(ids, k + 1, self.features)
            threshold = self.rounds.threshold if self.relaxed else None
            judged = v.judge(logits, hidden, drafts, q, threshold, self.relaxed, self.top_k, start)
            fed, prefill = len(ids), len(ids) != k + 1
        verdict = judged.verdict
        verify_s = time.perf_counter() - t0
        stats.verify_time_s += verify_s
        costs = self.run.costs
        if costs is not None and not prefill:
            with self.lock:  # a drafting thread feeds the same cost model
                costs.observe_target(fed, verify_s)
        n, strict = verdict.num_accepted, verdict.num_strict
        if tree is not None:
            stats.record_tree_round(len(tree), n, strict, entropies)
        else:
            stats.record_round(k, n, strict, verdict.num_relaxed, entropies)
        if forced:
            stats.grammar_drafted += k
        self._take_all()  # what was drafted during the forward (PEARL): the next window's first draft may be kept
        c = self.rounds.verified(chunk, n, verdict.next_token,
                                 accepted_tokens=judged.accepted if tree is not None else drafts[:n])
        self.last = c
        self._commit(c, verdict, judged, len(tree) - k if tree is not None else 0)
        return c.emitted, c.finish_reason, judged.emitted if self.run.top_logprobs is not None else None

    def _forced(self) -> Chunk | None:
        """What the grammar forces next, as a chunk of drafts (sequential rounds only)."""
        if self.grammar is None or self.proposer is None or self.LOOKAHEAD > 1:
            return None
        c = len(self.rounds.seq)
        cap = min(self.proposer.policy.params.max_draft_tokens, self.run.max_len - c - 1)
        forced = self.grammar.forced(cap) if cap > 0 else []
        if not forced:
            return None
        epoch = self.proposer.epoch
        return Chunk(c, [Token(epoch, c + i, tok, 1.0, 0.0, None) for i, tok in enumerate(forced)])

    def _next_chunk(self) -> Chunk:
        """What to verify now: the proposer drafts on this thread until the sequencer has a
        whole window (or a plain step) to send."""
        p = self.proposer
        while True:
            self._take_all()
            chunk = self.rounds.next_chunk()
            if chunk is not None:
                return chunk
            try:
                if (ready := p.prepare() if p is not None else None) is not None:
                    window, epoch, seq = ready
                    t0 = time.perf_counter()
                    d = p.next(seq)
                    p.drafted(window, epoch, seq, d, time.perf_counter() - t0)
                    continue
            except Exception as e:  # noqa: BLE001 - a draft that fails never fails the request
                self._failed(e)
                continue
            self._take_all()  # a window the policy gated: ended with nothing drafted
            if (chunk := self.rounds.next_chunk()) is not None:
                return chunk
            raise RuntimeError("the round has no window to verify and none to draft")

    def _commit(self, c, verdict, judged, side_nodes: int) -> None:
        """Tell the proposer what the verdict committed (it rolls back what disagrees, and feeds
        each judged window back to the policy)."""
        if not c.notify or self.proposer is None or self.closed:
            return
        self.commit_id += 1
        top = tuple(zip(judged.top[1], judged.top[0])) if judged.top is not None else ()
        with self.lock:
            self.proposer.commit(Commit(self.commit_id, tuple(c.tokens), c.k, verdict.num_strict, verdict.js_distances,
                                        top_logprobs=top, features=judged.features, side_nodes=side_nodes))
            self._notify()
        self._take_all()

    def _notify(self) -> None:
        """A commit landed (the drafting thread, where there is one, may go on)."""

    # -- the proposer's events -------------------------------------------------------------------
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
            self._failed(event)
        else:  # an Ack
            self.rounds.acknowledged(event.epoch)

    # -- a drafter that fails ----------------------------------------------------------------
    def _failed(self, e: Exception) -> None:
        if not self.run.engine.fallback:
            raise e
        log.warning("the drafter failed; the target goes on alone", exc_info=e)
        self._fall_back(f"the drafter failed: {type(e).__name__}: {e}", "failed")

    def _fall_back(self, reason: str, kind: str) -> None:
        s = self.stats
        s.fallback, s.fallback_reason, s.fallback_kind = True, reason, kind
        self.rounds.stop_drafting()
        with self.lock:
            self.closed = True  # no more drafting (a drafting thread stops after its step in flight)
            self._notify()
