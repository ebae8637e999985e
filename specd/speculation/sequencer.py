"""The round across a transport, on the coordinating side: what to verify next and what a
verdict commits, with no stream, message format or clock in it (services.coordinator.loop moves
its events; docs/services.md, "Chunks, epochs and the PEARL overlap").

Where the drafts come from another process, they arrive by *position* and *epoch* ahead of the
committed sequence, and each window's end arrives on its own. The sequencer holds them and
answers, whenever the target is free:

- `next_chunk`: the drafts to verify now, from the committed sequence up to the end of the
  window they belong to ([]: a plain step; None: wait for the draft). Sequential, a chunk is a
  whole window once it has ended; with overlap (PEARL) a window still being drafted goes as far
  as it goes, and the first token does not wait for the draft's prefill.
- `steps`: how many windows of k = 0 the target may run back to back for it, where no draft
  will be verified before their end (the target alone, or the plain rounds the draft promised).
  A promise made on drafts that a rollback then discards (PEARL drafts the next window before
  the current one is judged) goes with them, on both sides.
- `verified`: a verdict's tokens committed (EOS and length cut them, specd.speculation.round),
  the drafts it settled forgotten, and whether the draft must be told (a commit it acknowledges
  with its epoch; until then no chunk is sent, unless the draft promised plain rounds).
- `acknowledged`: the draft's epoch after a commit; a newer one means it rolled back, and what
  was held of older epochs is stale.

A draft token is anything with `epoch`, `position`, `token`; a window end anything with `epoch`,
`start`, `end`, `repeat`, `side_tokens`, `side_parents` (the draft service's messages).
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

from specd.speculation.round import commit_tokens


@dataclass(slots=True)
class Chunk:
    """Drafts to verify from `start`: the tokens (draft-token objects) and, where the chunk is a
    whole window the draft grew into a tree (specd.tree), its side nodes."""

    start: int
    drafts: list
    side_tokens: tuple[int, ...] = ()
    side_parents: tuple[int, ...] = ()


@dataclass(slots=True)
class Committed:
    """What a verdict committed: `tokens` verified (accepted drafts, then the recovered or bonus
    token), `emitted` the part of them kept (cut at EOS or the length), the judged window's size
    `k` and accepted count `n`, and whether the draft must be told (`notify`)."""

    start: int
    tokens: list[int]
    emitted: list[int]
    k: int
    n: int
    finish_reason: str | None
    continuation_kept: bool  # the next window's first draft was the bonus token (PEARL)
    notify: bool


class Sequencer:
    def __init__(self, prompt: Sequence[int], *, max_length: int, eos: Container[int], overlap: bool,
                 drafting: bool):
        """drafting: a draft side proposes the windows (False: the target alone, or drafting on
        the target, where every chunk is empty)."""
        self.seq = list(prompt)  # committed tokens
        self.prompt_len, self.max_length, self.eos, self.overlap = len(prompt), max_length, eos, overlap
        self.drafting = drafting
        self.drafts: dict[int, object] = {}  # position -> draft token, ahead of seq
        self.window_ends: list = []
        # Plain rounds the draft promised: it drafts nothing in [from, until), promised in `epoch`.
        self.plain_from = self.plain_until = self.plain_epoch = 0
        self.epoch = 0  # the draft's epoch as of its last acknowledgement
        self.unacked = 0  # commits the draft has not acknowledged
        self.threshold: float | None = None  # AdaSD's relaxed threshold, as the draft last said

    # -- the draft's events -----------------------------------------------------------------
    def proposed(self, token) -> None:
        if token.epoch >= self.epoch and token.position >= len(self.seq):
            self.drafts[token.position] = token

    def window_ended(self, window, threshold: float | None = None) -> None:
        if window.epoch < self.epoch:
            return
        self.window_ends.append(window)
        if window.start == window.end and window.repeat > 1:
            self.plain_from, self.plain_until = window.start, window.start + window.repeat
            self.plain_epoch = window.epoch
        if threshold is not None:
            self.threshold = threshold

    def acknowledged(self, epoch: int) -> None:
        self.unacked -= 1
        if epoch > self.epoch:  # the draft rolled back: what we hold is stale
            self.epoch = epoch
            self.drafts = {p: t for p, t in self.drafts.items() if t.epoch >= epoch}
            self.window_ends = [w for w in self.window_ends if w.epoch >= epoch]
            if self.plain_epoch < epoch and len(self.seq) < self.plain_until:
                self.plain_from = self.plain_until = 0  # promised past drafts the rollback discarded

    def stop_drafting(self) -> None:
        """The draft is gone (fallback): the target alone from here."""
        self.drafting = False
        self.drafts.clear()
        self.window_ends.clear()

    # -- what the target verifies -------------------------------------------------------------
    def next_chunk(self) -> Chunk | None:
        c = len(self.seq)
        if not self.drafting or self._in_plain(c):
            return Chunk(c, [])  # a plain round the draft promised: its commits need no acknowledgement first
        if self.overlap and c == self.prompt_len and not self.drafts and not self.window_ends:
            return Chunk(c, [])  # PEARL: the first token does not wait for the draft's prefill
        if self.unacked:
            return None
        limit = self.max_length - 1 - c  # the target emits one token after the chunk
        if limit <= 0:
            return Chunk(c, [])  # the last token: nothing may be drafted, the draft waits
        end = next((w.end for w in self.window_ends if w.start <= c < w.end or w.start == w.end == c), None)
        if end is None and not self.overlap:
            return None  # sequential: verify whole windows only
        drafts = []
        while c + len(drafts) in self.drafts and len(drafts) < limit and (end is None or c + len(drafts) < end):
            drafts.append(self.drafts[c + len(drafts)])
        if not drafts and end is None:
            return None
        return Chunk(c, drafts, *self._tree_side(c, len(drafts)))

    def _in_plain(self, c: int) -> bool:
        """Whether position c is in the plain rounds the draft promised. The first of them waits
        for every commit before it to be acknowledged: one that rolled the draft back also took
        the promise (made on the drafts it discarded) away."""
        return self.plain_from <= c < self.plain_until and (c > self.plain_from or not self.unacked)

    def _tree_side(self, start: int, k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The side nodes of the window a chunk from `start` of k drafts is, when it is the whole
        window and the draft grew it into a tree; a part of one verifies a chain."""
        for w in self.window_ends:
            if w.start == start and w.end == start + k and w.side_tokens:
                return tuple(w.side_tokens), tuple(w.side_parents)
        return (), ()

    def steps(self, chunk: Chunk, back_to_back: bool) -> int:
        """Decoding steps to ask for: for an empty chunk, every step up to the next draft to
        verify (back_to_back: the target can run several for one request), else one."""
        if chunk.drafts or not back_to_back:
            return 1
        if self.drafting and not self._in_plain(len(self.seq)):
            return 1
        until = self.max_length if not self.drafting else self.plain_until
        return max(min(until, self.max_length) - len(self.seq), 1)

    def verified(self, chunk: Chunk, num_accepted: int, next_token: int, *, drafted: int = 0,
                 accepted_tokens: Sequence[int] = ()) -> Committed:
        """Commit a verdict of `chunk` (or of one of its steps run back to back). drafted: drafts the
        target drafted itself for it; accepted_tokens: the accepted path where it is not the
        chunk's leading drafts (a tree's path, or the target's own drafts)."""
        n, k = num_accepted, len(chunk.drafts) + drafted
        side = bool(chunk.side_tokens)
        accepted = list(accepted_tokens) if side or drafted else [t.token for t in chunk.drafts[:n]]
        tokens = accepted + [next_token]
        start = len(self.seq)
        ahead = self.drafts.get(start + n) if n == k and not side else None
        kept = ahead is not None and ahead.token == next_token
        emitted, finish = commit_tokens(tokens, start, self.eos, self.max_length)
        self.seq += emitted
        for pos in range(start, start + len(tokens)):
            self.drafts.pop(pos, None)
        c = len(self.seq)
        self.window_ends = [w for w in self.window_ends if w.end > c or w.start == w.end == c]
        notify = finish is None and self.drafting
        if notify:
            self.unacked += 1
        return Committed(start, tokens, emitted, k, n, finish, kept, notify)

