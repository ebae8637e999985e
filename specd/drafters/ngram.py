"""ngram and retrieval: prompt-lookup drafting (Saxena 2023) and its datastore form (REST,
He et al. 2024), no model.

Find the longest suffix of the sequence (at most max_ngram tokens, at least min_ngram) that
occurred earlier in prompt + generated text, take its most recent occurrence, and propose the
tokens that followed it, up to `lookahead` of them: the draft length comes from the match's own
continuation, and there is no draft at all without a match. The draft distribution is a point
mass on each proposed token. Every token carries what a cost-aware policy calibrates its
acceptance estimate on: the match length it came from (a long match is a repeated passage, a
one-token match is a guess) and its votes, how many occurrences of the match (those that agreed
with the window so far) go on at this point and the share of them that go on with this token
(a phrase that always continues the same way, or a contested guess).

`retrieval` also searches a datastore of the target's own answers to other prompts
(specd.drafters.datastore) and proposes its continuation when the datastore's match is longer
than the one in this request's own text. Its tokens are marked `retrieved`, so a cost-aware
policy calibrates them apart from the request's own repetitions.

Both offer alternatives for a draft tree (`branches`, specd.tree): what followed the other
occurrences of the match, in the request and in the datastore.
"""

from __future__ import annotations

import numpy as np

from specd.drafters.base import Drafter, DraftSession, DraftToken
from specd.drafters.datastore import TAIL, Datastore, Walk, voters
from specd.sampling import race_row

MAX_ALTERNATIVES = 4  # datastore candidates offered per round (the engine keeps up to 3 branches)
FEW_ENDS = 48  # suffix_matches narrows more occurrences than this with numpy


def suffix_matches(seq: np.ndarray, max_ngram: int) -> tuple[np.ndarray, int]:
    """(every earlier position where the longest suffix of seq also ends, in order; its length),
    capped at max_ngram tokens; (empty, 0) if not even the last token occurred before."""
    n = len(seq)
    if n < 2:
        return np.zeros(0, np.int64), 0
    alive = np.flatnonzero(seq[:-1] == seq[-1])  # earlier ends of a 1-token match
    if alive.size == 0:
        return alive, 0
    length = 1
    # Many occurrences (a long text, a frequent token) are narrowed with numpy; the few left in
    # Python, where numpy's per-call cost outweighs the work: this runs before every drafted
    # window (on a GPU a step is only milliseconds).
    while alive.size > FEW_ENDS and length < max_ngram:
        longer = alive[alive >= length]
        longer = longer[seq[longer - length] == seq[n - 1 - length]]
        if longer.size == 0:
            return alive, length
        alive, length = longer, length + 1
    item, ends = seq.item, alive.tolist()  # item: one element, not the whole text as a list
    best = ends
    while length < max_ngram:
        want = item(n - 1 - length)  # room to extend the match one token further back, and a match
        ends = [e for e in ends if e >= length and item(e - length) == want]
        if not ends:
            break
        length, best = length + 1, ends
    return np.asarray(best, np.int64), length


class NgramSession(DraftSession):
    inline = True  # a window's proposal is one lookup, handed out token by token

    def __init__(self, max_ngram: int, min_ngram: int, lookahead: int, datastore: Datastore | None = None,
                 vocab_size: int | None = None):
        self.max_ngram, self.min_ngram, self.lookahead = max_ngram, min_ngram, lookahead
        self.datastore = datastore
        self.vocab_size = vocab_size  # the target's: coupled sampling's race noise rows
        self.walk: Walk | None = None  # this round's proposal, handed out token by token
        self.match_len = 0
        self.retrieved = False  # the proposal comes from the datastore
        self.next_len = -1  # len(seq) at which the walk's next token is the next token
        # The request's text as an array, kept across rounds: each lookup copies only the tokens
        # new since the last one (a long prompt's copy cost more than the lookup); `rollback`
        # marks what is no longer the text.
        self.text = np.zeros(0, np.int64)
        self.synced = 0  # tokens of self.text that are the start of the request's text

    def next(self, seq, params, generator, want_hidden):
        noise = None
        if params.coupled and self.vocab_size:
            noise = race_row(params.seed, len(seq), self.vocab_size).numpy()
        got = self.walk.next(noise) if self.walk is not None and len(seq) == self.next_len else None
        if got is None:
            self._lookup(seq, noise is not None)
            got = self.walk.next(noise) if self.walk is not None else None
            if got is None:
                self.walk = None
                return None
        token, votes, support = got
        self.next_len += 1
        return DraftToken(token, None, 1.0, 1.0, 0.0, None, self.match_len, self.retrieved, votes, support,
                          float(noise[token]) if noise is not None else -1.0)

    def _array(self, seq: list[int]) -> np.ndarray:
        """seq as an int64 array (a view of self.text), copying only what is new since the last
        lookup; a text that does not end its synced part as the last one did starts over."""
        n, m = len(seq), self.synced
        if m > n or (m and self.text[m - 1] != seq[m - 1]):
            m = 0
        if len(self.text) < n:
            grown = np.empty(max(n, 2 * len(self.text), 256), np.int64)
            grown[:m] = self.text[:m]
            self.text = grown
        if n > m:
            self.text[m:n] = seq[m:n]
        self.synced = n
        return self.text[:n]

    def _lookup(self, seq: list[int], race: bool) -> None:
        arr = self._array(seq)
        ends, length = suffix_matches(arr, self.max_ngram)
        if length < self.min_ngram:
            length = 0
        self.walk = Walk(arr, ends, "race" if race else "recent", self.lookahead) if length else None
        self.retrieved = False
        if self.datastore is not None and length < self.max_ngram:
            found, found_len = self.datastore.match(arr[-self.max_ngram:])
            if found_len > length and found_len >= self.min_ngram:  # ties: the request's own text
                limit = min(self.lookahead, TAIL)  # separators after the text: no range checks
                self.walk = Walk(self.datastore.data, voters(found), "race" if race else "majority", limit)
                length, self.retrieved = found_len, True
        self.match_len, self.next_len = length, len(seq)

    def branches(self, seq, chain, length, params=None):
        """The continuations after every earlier occurrence of the longest match in this
        request's text (most recent first, one per next token), then the datastore's
        alternatives; the engine merges them with `chain` and keeps the first few that differ."""
        arr = np.asarray(seq, dtype=np.int64)
        out, firsts = [], set()
        ends, own_len = suffix_matches(arr, self.max_ngram)
        if own_len >= self.min_ngram:
            for e in ends[::-1].tolist():
                token = int(arr[e + 1])
                if token not in firsts:
                    firsts.add(token)
                    out.append(arr[e + 1:e + 1 + length].tolist())
        if self.datastore is not None:
            found, found_len = self.datastore.match(arr[-self.max_ngram:])
            if found_len >= self.min_ngram:  # after the request's most recent repeat
                out[1:1] = self.datastore.alternatives(found, MAX_ALTERNATIVES, length)
        return out

    def rollback(self, length: int) -> None:
        self.synced = min(self.synced, length)
        if length < self.next_len:
            self.walk, self.next_len = None, -1


class NgramDrafter(Drafter):
    kind = "ngram"
    has_distribution = False
    datastore: Datastore | None = None
    # Draft trees (specd.tree) on request only: on the 2-core CPU they cost about as much per
    # verification as they added per round (docs/engine.md, "Draft trees").
    branches = 0
    branch_length = 4

    def __init__(self, max_ngram: int = 8, min_ngram: int = 1, lookahead: int = 64):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.lookahead = max_ngram, min_ngram, lookahead

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.max_ngram}" + (f"-min{self.min_ngram}" if self.min_ngram > 1 else "")

    def open(self, vocab_size: int | None = None) -> NgramSession:
        return NgramSession(self.max_ngram, self.min_ngram, self.lookahead, self.datastore, vocab_size)


class RetrievalDrafter(NgramDrafter):
    """Prompt lookup, then a datastore of the target's own answers (REST)."""

    kind = "retrieval"

    def __init__(self, datastore: Datastore, max_ngram: int = 8, min_ngram: int = 1, lookahead: int = 64):
        super().__init__(max_ngram, min_ngram, lookahead)
        self.datastore = datastore
