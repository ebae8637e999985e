"""The draft side of the round: windows of draft tokens proposed ahead of the committed
sequence, with no transport in it. The draft service (services.draft.runner) and PEARL in
process (specd.speculation.overlap) move its events.

The proposer drafts token after token on its own guesses, asks the stopping policy after
each one (docs/engine.md) and publishes every token the moment it exists. A window ends
when the policy says stop (or at the cap, the length limit, or when the drafter has no
proposal). With `lookahead` 1 it then waits for the window's verification (sequential
speculative decoding); with 2 it goes on drafting the next window on top of the current one
while the target verifies (PEARL post-verify, Liu et al. 2024).

A commit says what verification appended to the committed sequence. Drafts that agree with
it stay; at the first disagreement the proposer rolls back, bumps its *epoch* (so that the
verifying side can tell stale tokens from fresh ones) and drafts from the new sequence. Each
window, once verification has judged it, is fed back to the policy (`observe`).

A driver repeats: `prepare` (the window to extend, or None: wait for a commit), one draft
step after the sequence it returned (the model may run elsewhere meanwhile), `drafted`; and
applies each `commit` as it comes, also while a step is in flight (`drafted` then drops the
step's moot proposal). It serializes these calls (one event loop, or one lock).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specd.drafters.base import DraftSession, DraftToken
from specd.dvi import Record
from specd.errors import InvalidRequest
from specd.policies import Decision, StoppingPolicy
from specd.sampling import request_generator
from specd.speculation.pace import PaceClock
from specd.tree import TreePlanner
from specd.types import DraftStep, RoundOutcome, SamplingParams


# The round's events are built per draft token on the host's hot path: not frozen (a frozen
# dataclass is several times slower to build); nothing changes one once published.
@dataclass(slots=True)
class Token:
    epoch: int
    position: int  # index in the whole sequence
    token: int
    prob: float
    entropy: float
    q: torch.Tensor | None


@dataclass(slots=True)
class WindowEnd:
    epoch: int
    start: int
    end: int
    reason: str  # policy | cap | no_proposal | length
    relaxed_threshold: float | None
    repeat: int = 0  # an empty window that holds this many rounds, k = 0 each (the coordinator need not wait)
    side_tokens: tuple[int, ...] = ()  # the window as a draft tree: side nodes beside its tokens
    side_parents: tuple[int, ...] = ()  # (DraftTree.side: -1 the root, then the window's tokens, then side nodes)


@dataclass(slots=True)
class Ack:
    commit_id: int
    epoch: int


@dataclass(slots=True)
class Commit:
    commit_id: int
    tokens: tuple[int, ...]  # accepted drafts, then the recovered or bonus token
    num_verified: int  # draft tokens the verification judged
    num_strict: int  # leading ones accepted by the lossless rule
    js_distances: tuple[float, ...] = ()
    # DVI: the target's (ids, log-probs) at the judged draft positions, in order
    top_logprobs: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    # feature drafters: (start, the target's hidden states [n, H]) of the newly committed positions
    features: tuple[int, torch.Tensor] | None = None
    # the load of the target forward that verified it: other sessions and their new tokens
    other_sessions: int | None = None  # None: not known (in process), and not observed
    other_tokens: int = 0
    side_nodes: int = 0  # verified as a draft tree with this many side nodes beside the chain
    other_yield: int | None = None  # the tokens the other sessions emitted, where known


@dataclass
class _Window:
    start: int
    tokens: list[int] = field(default_factory=list)
    steps: list[DraftStep] = field(default_factory=list)  # what the policy saw for each token
    dropped: DraftStep | None = None  # the token the policy dropped after these (Decision.DROP)
    ended: bool = False
    hit_cap: bool = False
    gated: bool = False  # should_draft declined: a plain round, the drafter did not run
    stretch: int = 0  # gated: the plain rounds it opens, itself included

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class Proposer:
    def __init__(self, session: DraftSession, policy: StoppingPolicy, sampling: SamplingParams,
                 prompt: list[int], *, max_length: int, lookahead: int, send_q: bool,
                 publish: Callable[[object], None],
                 log_records: Callable[[list[Record]], None] | None = None,
                 adapter_version: Callable[[], int] = lambda: 0,
                 load_caps: tuple[tuple[int, int], ...] = (), trees: TreePlanner | None = None,
                 t_target: Callable[[float], float] | None = None, generator: torch.Generator | None = None,
                 round_trip: bool = True):
        """publish: takes each Token, WindowEnd and Ack as it happens.
        load_caps: (sessions, cap) pairs, ascending: with at least `sessions` sessions in the
        target's last forward for this session, a window holds at most `cap` drafts (0: none).
        trees: grows each window into a draft tree (specd.tree), priced on t_target, the target's
        seconds for a forward over n tokens. generator: the drafter's random numbers (default:
        the request's, specd.sampling.request_generator). round_trip: each round the target asks
        for pays a round trip to this proposer, which a stretch of plain rounds skips after its
        first (a transport between them; in process, none)."""
        self.session, self.policy, self.sampling = session, policy, sampling
        self.seq = list(prompt)  # committed tokens, then this proposer's own drafts
        self.prompt_len = len(prompt)
        self.committed = len(prompt)
        self.max_length, self.lookahead, self.send_q = max_length, lookahead, send_q
        self.publish = publish
        self.log_records, self.adapter_version = log_records, adapter_version  # online learning (DVI)
        self.want_hidden = policy.needs_hidden or log_records is not None
        self.top: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # position -> the target's top log-probs
        self.epoch = 0
        self.windows: list[_Window] = []  # not yet judged, in sequence order
        self.strict: dict[int, bool] = {}  # position -> accepted by the lossless rule
        self.js: dict[int, float] = {}
        self.rollback_to: int | None = None  # KV rollback to apply before the next forward
        self.features: list[tuple[int, torch.Tensor]] = []  # target features to hand over, after it
        self.emitted: dict[int, int] = {}  # position -> committed token, while a dropped token awaits it
        self.num_drafted = 0
        self.draft_seconds = 0.0
        self.generator = generator if generator is not None else request_generator(sampling)
        self.pace = PaceClock(policy)  # rounds timed commit to commit (specd.speculation.pace)
        self.round_trip = round_trip
        self.load_caps = load_caps
        self.sessions = 1  # in the target forward that verified this session's last chunk
        self.plain_from = self.plain_until = 0  # no drafting in [from, until): a stretch of plain rounds promised
        self.trees, self.t_target = trees, t_target
        self.rounds = self.accepted = 0  # verifications and the drafts they kept (a tree's mean tokens)
        self.vocab_size: int | None = None  # ids a commit may carry (None: any id >= 0)

    # -- drafting -----------------------------------------------------------------------------
    def prepare(self) -> tuple[_Window, int, list[int]] | None:
        """The next draft step's (window, epoch, sequence to draft after), with the draft session
        brought up to date (a rollback a commit asked for, the target's features it brought);
        None where drafting waits for a commit."""
        window = self._window_to_extend()
        if window is None:
            return None
        if self.rollback_to is not None:
            self.session.rollback(self.rollback_to)
            self.rollback_to = None
        for start, hidden in self.features:
            self.session.observe_target(start, hidden)
        self.features.clear()
        return window, self.epoch, list(self.seq)

    def next(self, seq: list[int]) -> DraftToken | None:
        """One draft step after seq, on the session alone (a driver may batch it instead)."""
        return self.session.next(seq, self.sampling, self.generator, self.want_hidden)

    def drafted(self, window: _Window, epoch: int, seq: list[int], d: DraftToken | None, seconds: float) -> None:
        """A draft step's proposal d after seq (prepare's), which took `seconds`; dropped where a
        commit changed the sequence meanwhile."""
        self.draft_seconds += seconds
        if self.policy.resources.costs is not None:
            self.policy.resources.costs.observe_draft(seconds)
        if epoch != self.epoch or len(self.seq) != len(seq):
            return  # a commit changed the sequence meanwhile: this proposal is moot
        self._add(window, d)

    def _window_to_extend(self) -> _Window | None:
        """The open window, or a new one when fewer than `lookahead` ended windows await
        verification; None when drafting must wait for a commit."""
        if self.windows and not self.windows[-1].ended:
            return self.windows[-1]
        if len(self.windows) >= self.lookahead or len(self.seq) > self.max_length - 2:
            return None
        if len(self.seq) < self.plain_until:
            return None  # inside a stretch of plain rounds
        if self.windows and not self.windows[-1].tokens:
            return None  # an empty window: nothing new to draft from until a commit
        self.policy.begin_round()
        window = _Window(len(self.seq))
        self.windows.append(window)
        by_load = self._cap() == 0
        if by_load or not self.policy.should_draft():
            # An empty window: the coordinator verifies a plain step, and the next ones too where
            # the policy already knows it will not draft (no round trip to the draft for them).
            window.gated = True
            # With trees every round is asked for (a gated round may still verify the lookups).
            stretch = 1 if by_load or self.trees is not None else self.policy.plain_rounds()
            rounds = max(1, min(stretch, self.max_length - 1 - window.start))
            self.plain_from, self.plain_until = window.start, window.start + rounds
            window.stretch = rounds
            self._end(window, "policy", rounds, tree=not by_load)
            return None
        return window

    def _add(self, window: _Window, d: DraftToken | None) -> None:
        if d is None:
            return self._end(window, "no_proposal")
        step = d.step(len(window.tokens) + 1, len(self.seq) - self.prompt_len)
        decision = self.policy.decide(step)
        if decision is Decision.DROP:
            window.dropped = step
            # The session's state may hold the dropped token (a lookup's walk goes on past it):
            # it drafts the next window from the sequence without it.
            at = len(self.seq)
            self.rollback_to = at if self.rollback_to is None else min(self.rollback_to, at)
            return self._end(window, "policy")
        self.seq.append(d.token)
        window.tokens.append(d.token)
        window.steps.append(step)
        self.num_drafted += 1
        self.publish(Token(self.epoch, len(self.seq) - 1, d.token, d.prob, d.entropy,
                           d.q if self.send_q else None))
        if decision is Decision.STOP:
            self._end(window, "policy")
        elif len(window.tokens) >= self._cap():
            window.hit_cap = True
            self._end(window, "cap")
        elif len(self.seq) > self.max_length - 2:  # a draft here could never be followed by the target's
            self._end(window, "length")

    def _cap(self) -> int:
        """Drafts a window may hold: the policy's cap, lowered by the load (load_caps)."""
        cap = self.policy.params.max_draft_tokens
        for sessions, load_cap in self.load_caps:
            if self.sessions >= sessions:
                cap = min(cap, load_cap)
        return cap

    def _end(self, window: _Window, reason: str, repeat: int = 0, tree: bool = True) -> None:
        window.ended = True
        side = self._tree(window) if tree and self.trees is not None else ((), ())
        self.publish(WindowEnd(self.epoch, window.start, window.end, reason, self.policy.relaxed_threshold(),
                               repeat, *side))

    def _tree(self, window: _Window) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The window grown into a draft tree (TreePlanner.grow): its side nodes' tokens and parents."""
        t0 = time.perf_counter()
        mean = self.accepted / self.rounds + 1.0 if self.rounds else 0.0
        tree = self.trees.grow(self.session, self.seq[:window.start], list(window.tokens),
                               self.max_length - window.start - 1, self.sampling, mean, self.t_target)
        self.draft_seconds += time.perf_counter() - t0  # the alternatives' lookups are drafting
        tokens, parents = tree.side()
        return tuple(tokens), tuple(parents)

    # -- commits ------------------------------------------------------------------------------
    def commit(self, c: Commit) -> None:
        """Apply a verification: drafts that equal the committed tokens stay, the rest roll back.
        InvalidRequest for a token id outside the vocabulary: fed to the draft model, it would
        index past its embeddings (a device-side assert on CUDA, which ends the process)."""
        bad = next((t for t in c.tokens if not 0 <= t < (self.vocab_size or 1 << 31)), None)
        if bad is not None:
            raise InvalidRequest("tokens", f"committed token ids must be in [0, {self.vocab_size}), got {bad}"
                                 if self.vocab_size else f"committed token ids must be >= 0, got {bad}")
        s, new = self.committed, c.tokens
        n = len(new) - 1
        self._pace(s, len(new))
        self.sessions = 1 + (c.other_sessions or 0)
        self.rounds += 1
        self.accepted += n
        if c.side_nodes and self.trees is not None:
            self.trees.observe(c.side_nodes, n, c.num_strict)
        if self.policy.resources.costs is not None and c.other_sessions is not None:
            self.policy.resources.costs.observe_load(c.other_sessions, c.other_tokens, c.other_yield)
        for i, tok in enumerate(new):
            if i < c.num_verified:  # judged by the target: accepted by the lossless rule or not
                self.strict[s + i] = i < c.num_strict
            elif s + i < len(self.seq):  # drafted past the chunk: right if it equals what was committed
                self.strict[s + i] = self.seq[s + i] == tok
        for i, d in enumerate(c.js_distances):
            self.js[s + i] = d
        if c.features is not None:
            self.features.append(c.features)
        if self.log_records is not None:
            for i, top in enumerate(c.top_logprobs):
                self.top[s + i] = top
        nxt = s + n  # position of the recovered or bonus token
        for w in self.windows:  # a dropped token is judged by the token committed in its place
            if w.dropped is not None and s <= w.end <= nxt:
                self.emitted[w.end] = new[w.end - s]
        drafted = min(len(new), len(self.seq) - s)
        agree = next((i for i in range(drafted) if self.seq[s + i] != new[i]), drafted)
        if agree < drafted:  # a draft the verification did not keep: it and what follows go
            del self.seq[s + agree:]
            self.rollback_to = s + agree
            self.epoch += 1
            if s + agree < self.plain_from:  # a stretch promised on the discarded drafts (PEARL) goes too
                self.plain_from = self.plain_until = 0
        elif len(self.seq) < s + len(new):
            # Verification overtook the drafting (PEARL pre-verify, or a tree's longer side path):
            # the open window ends where its drafts do, and the next draft starts a new one (a
            # window's tokens are contiguous positions). After a rollback, judging drops it.
            self._cut_open_window(len(self.seq))
        self.seq += new[len(self.seq) - s:]
        self.committed = nxt + 1
        self.publish(Ack(c.commit_id, self.epoch))
        self._judge_windows()

    def _pace(self, start: int, tokens: int) -> None:
        """Time the round that verified from `start`, from the previous commit to this one (the
        first commit also waited for the prompt's prefill and is not timed). Under PEARL a window
        verified in parts is timed per part; a chunk with no window of its own is not timed.
        Nor, across a transport (round_trip), is the first round of a stretch of plain rounds: it
        paid the round trip to ask this service, which the stretch's others skip (the target runs
        them back to back), so they alone time what a plain stretch costs a token."""
        window = next((w for w in self.windows if w.start == start), None)
        timed = (window is not None and (window.stretch <= 1 or not self.round_trip)) or \
            (window is None and start < self.plain_until)
        self.pace.commit(tokens, window is not None and not window.gated, timed)

    def _cut_open_window(self, at: int) -> None:
        """End the window being drafted at position `at` (now committed), without a WindowEnd:
        the coordinator is past it already. An empty one is dropped."""
        if self.windows and not self.windows[-1].ended:
            window = self.windows[-1]
            if window.tokens:
                assert window.end == at, (window.start, len(window.tokens), at)
                window.ended = True
            else:
                self.windows.pop()

    def _judge_windows(self) -> None:
        """Feed each judged window back to the policy; forget windows past a rollback."""
        keep = []
        for w in self.windows:
            if w.start >= len(self.seq) or (w.ended and not w.tokens and w.dropped is None):
                continue  # drafted on a discarded guess, or an empty window the commit made moot
            judged = [self.strict.get(w.start + i) for i in range(len(w.tokens))]
            settled = w.ended and None not in judged and (w.dropped is None or w.end in self.emitted)
            if False in judged or settled:
                self._observe(w, judged)
            else:
                keep.append(w)
        self.windows = keep
        oldest = keep[0].start if keep else self.committed
        for pos in [p for p in self.strict if p < oldest]:
            del self.strict[pos]
            self.js.pop(pos, None)
            self.top.pop(pos, None)
        for pos in [p for p in self.emitted if p < oldest]:
            del self.emitted[pos]

    def _observe(self, w: _Window, judged: list[bool | None]) -> None:
        n = next((i for i, ok in enumerate(judged) if not ok), len(judged))
        js = tuple(self.js[w.start + i] for i in range(len(w.tokens)) if w.start + i in self.js)
        w.ended = True
        self.policy.observe(RoundOutcome.judged(w.steps, n, w.hit_cap, js, w.dropped, self.emitted.get(w.end)))
        if self.log_records is not None:
            self._log(w, judged, n)

    def _log(self, w: _Window, judged: list[bool | None], n: int) -> None:
        """DVI: the window's drafts up to and including the first rejected one, each with the
        target's top log-probs there (positions the target did not judge, such as a draft that
        was compared with a bonus token, have none and are left out)."""
        version = self.adapter_version()
        records = []
        for i in range(min(n + 1, len(w.tokens))):
            top, step = self.top.get(w.start + i), w.steps[i]
            if top is None or judged[i] is None or step.hidden is None:
                continue
            records.append(Record(step.hidden.detach().float().cpu(), w.tokens[i], float(judged[i]), top[0], top[1],
                                  version))
        if records:
            self.log_records(records)
