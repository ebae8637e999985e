"""ngram: prompt-lookup drafting (Saxena 2023), no model.

Find the most recent earlier occurrence of the sequence's last n tokens (n from max_ngram
down to min_ngram) in prompt + generated text and propose the tokens that followed it.
The draft distribution is a point mass on each proposed token.
"""

from __future__ import annotations

import numpy as np

from specd.drafters.base import Drafter, DraftSession, DraftToken


class NgramSession(DraftSession):
    def __init__(self, max_ngram: int, min_ngram: int, lookahead: int):
        self.max_ngram, self.min_ngram, self.lookahead = max_ngram, min_ngram, lookahead
        self.proposal: list[int] = []  # continuation found for the current round
        self.next_len = -1  # len(seq) at which proposal[0] is the next token

    def next(self, seq, params, generator, want_hidden):
        if len(seq) != self.next_len or not self.proposal:
            self.proposal = self._lookup(seq)
            self.next_len = len(seq)
            if not self.proposal:
                return None
        token = self.proposal.pop(0)
        self.next_len += 1
        return DraftToken(token, None, 1.0, 1.0, 0.0)

    def _lookup(self, seq: list[int]) -> list[int]:
        arr = np.asarray(seq, dtype=np.int64)
        for n in range(min(self.max_ngram, len(arr) - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # all earlier n-grams
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent match
                return arr[start:start + self.lookahead].tolist()
        return []

    def rollback(self, length: int) -> None:
        if length < self.next_len:
            self.proposal, self.next_len = [], -1


class NgramDrafter(Drafter):
    kind = "ngram"
    has_distribution = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, lookahead: int = 64):
        self.max_ngram, self.min_ngram, self.lookahead = max_ngram, min_ngram, lookahead

    @property
    def name(self) -> str:
        return f"ngram-{self.max_ngram}"

    def open(self, vocab_size: int | None = None) -> NgramSession:
        return NgramSession(self.max_ngram, self.min_ngram, self.lookahead)
