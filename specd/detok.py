"""Incremental detokenization for streaming: token ids in, stable text deltas out.

Text is decoded over a sliding window of ids, as text-generation-inference does: the ids of
the last released chunk (`prefix`) are decoded together with the new ones and only the text
beyond the prefix's own decoding is new. This keeps tokenizers that drop or add a leading
space at a chunk boundary (SentencePiece) correct, and costs O(window) per push instead of
decoding the whole generation every time.

Two kinds of text are held back until later ids settle them:
- a trailing U+FFFD: a byte-level BPE token stopped inside a UTF-8 character and a later
  one completes it (the text before it is released; the window is decoded again later);
- the longest suffix that could be the start of a stop string ("\\nUs" while stop is
  "\\nUser:"): it is released once it can no longer become one, or at finish().
When a stop string appears, the text is cut before it, `stopped` is set, and the delta
reports only the ids up to the one that completed the stop string (the fewest ids whose
decoding contains it). The engine (specd.engine) cuts its tokens at stop strings with it;
the services stream text with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

REPLACEMENT_CHAR = "\ufffd"  # what decoding yields for an incomplete UTF-8 sequence


@dataclass(frozen=True)
class Delta:
    """What one push released: the ids it kept and the new stable text."""

    token_ids: tuple[int, ...]
    text: str


class TextStream:
    """keep: control tokens whose text stays in the text, id -> text (decoding drops control
    tokens; a tool-call format written with them needs them, specd.tools.call_tokens)."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), keep: dict[int, str] | None = None):
        self.tokenizer = tokenizer
        self.keep = keep or {}
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []  # every kept id, in order
        self.stopped = False
        self._prefix = 0  # ids[_prefix:_read] is the last decoded chunk, context for the next
        self._read = 0  # ids before _read are decoded into the stable text
        self._pieces: list[str] = []  # the stable text (of ids[:_read], cut at a stop string), in pieces
        self._stable_len = 0
        self._tail = ""  # text of ids[_read:] before a character they split
        self._released = 0  # characters of self.text already returned
        self._longest = max(map(len, self.stop), default=0)

    @property
    def text(self) -> str:
        """The text decoded so far, without any incomplete character."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return (self._pieces[0] if self._pieces else "") + self._tail

    def push(self, token_ids: Sequence[int]) -> Delta:
        """Add newly generated ids; returns the text that became stable."""
        if self.stopped:
            return Delta((), "")
        start, mark = len(self.ids), self._mark()
        self.ids.extend(token_ids)
        self._decode_window(final=False)
        return self._release(start, mark, final=False)

    def finish(self) -> Delta:
        """The generation ended: release everything still held back."""
        if self.stopped:
            return Delta((), "")
        mark = self._mark()
        self._decode_window(final=True)
        return self._release(len(self.ids), mark, final=True)

    # -- internals --------------------------------------------------------------------------
    # Every step costs O(new ids + longest stop string): the text is kept in pieces and only
    # its unreleased end is looked at, so a long generation never makes a push slower.

    def _decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:  # an id-only model: tokens, no text
            return ""
        if not self.keep or self.keep.keys().isdisjoint(ids):
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)
        parts, run = [], []
        for i in ids:
            if i in self.keep:
                parts += [self.tokenizer.decode(run, skip_special_tokens=True), self.keep[i]]
                run = []
            else:
                run.append(i)
        return "".join(parts) + self.tokenizer.decode(run, skip_special_tokens=True)

    def _since(self, i: int) -> str:
        """self.text[i:], from the last pieces only."""
        need, parts = self._stable_len - i, []
        for piece in reversed(self._pieces):
            if need <= 0:
                break
            parts.append(piece if len(piece) <= need else piece[len(piece) - need:])
            need -= len(piece)
        stable = "".join(reversed(parts))
        return stable + self._tail[max(0, i - self._stable_len):]

    def _mark(self) -> tuple[int, int, str]:
        """What finding the ids through a stop needs of the state before a push: the window's
        start, the first id not yet decoded for good, and the stable text's last characters
        (a stop string found later ends beyond them, so no earlier text matters)."""
        recent = self._since(max(0, self._stable_len - self._longest))[:min(self._longest, self._stable_len)]
        return self._prefix, self._read, recent

    def _decode_window(self, final: bool) -> None:
        if self._read == len(self.ids):
            return
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        window_text = self._decode(self.ids[self._prefix:])
        new = window_text[len(prefix_text):]
        if new.endswith(REPLACEMENT_CHAR) and not final:
            # A character is split across tokens: keep what precedes it and decode this
            # window again once the rest of the character's bytes arrive.
            self._tail = new.rstrip(REPLACEMENT_CHAR)
        elif new or final:
            self._pieces.append(new)
            self._stable_len += len(new)
            self._tail = ""
            self._prefix, self._read = self._read, len(self.ids)

    def _release(self, start: int, mark: tuple[int, int, str], final: bool) -> Delta:
        """start: index of this push's first id; mark: the state before it (_mark)."""
        total = self._stable_len + len(self._tail)
        pending = self._since(self._released)
        cut = first_stop(pending, self.stop, 0)
        if cut is not None:
            self.stopped = True
            del self.ids[max(start, self._ids_through_stop(*mark)):]  # never un-report ids
            end = self._released + cut
            self._pieces, self._stable_len, self._tail = [self.text[:end]], end, ""
        else:
            recent = pending if final else self._since(max(0, total - self._longest))
            end = total if final else total - held_back(recent, self.stop)
            end = max(end, self._released)
        delta = Delta(tuple(self.ids[start:]), pending[:end - self._released])
        self._released = end
        return delta

    def _ids_through_stop(self, prefix: int, undecoded: int, before: str) -> int:
        """How many ids to keep: the fewest whose decoding contains a stop string. The text of
        ids[:end] is `before` and the window decoded from `prefix`; a stop string appearing is
        monotone in end, so a binary search over the new ids finds the first that completes one
        (a stop string holding U+FFFD is not monotone: a linear search then)."""
        context = len(self._decode(self.ids[prefix:undecoded]))

        def stops(end: int) -> bool:
            return first_stop(before + self._decode(self.ids[prefix:end])[context:], self.stop, 0) is not None

        lo, hi = undecoded + 1, len(self.ids)
        if any(REPLACEMENT_CHAR in s for s in self.stop):
            return next((end for end in range(lo, hi + 1) if stops(end)), hi)
        if lo > hi or not stops(hi):
            return hi
        while lo < hi:
            mid = (lo + hi) // 2
            if stops(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo


def first_stop(text: str, stop: tuple[str, ...], start: int) -> int | None:
    """Index of the earliest stop string in text[start:], or None."""
    found = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(found) if found else None


def held_back(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string: text
    that may still turn into a stop string and so must not be released yet.

    Releasing everything before that suffix is safe: a stop string that later appears cannot
    start inside released text, or a longer suffix would have matched here.
    """
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest
