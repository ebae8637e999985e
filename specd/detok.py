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
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []  # every kept id, in order
        self.stopped = False
        self._prefix = 0  # ids[_prefix:_read] is the last decoded chunk, context for the next
        self._read = 0  # ids before _read are decoded into _stable
        self._stable = ""  # text of ids[:_read] (cut at a stop string)
        self._tail = ""  # text of ids[_read:] before a character they split
        self._released = 0  # characters of self.text already returned

    @property
    def text(self) -> str:
        """The text decoded so far, without any incomplete character."""
        return self._stable + self._tail

    def push(self, token_ids: Sequence[int]) -> Delta:
        """Add newly generated ids; returns the text that became stable."""
        if self.stopped:
            return Delta((), "")
        start, undecoded = len(self.ids), self._read
        self.ids.extend(token_ids)
        self._decode_window(final=False)
        return self._release(start, undecoded, final=False)

    def finish(self) -> Delta:
        """The generation ended: release everything still held back."""
        if self.stopped:
            return Delta((), "")
        undecoded = self._read
        self._decode_window(final=True)
        return self._release(len(self.ids), undecoded, final=True)

    # -- internals --------------------------------------------------------------------------
    def _decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:  # an id-only model: tokens, no text
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

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
            self._stable += new
            self._tail = ""
            self._prefix, self._read = self._read, len(self.ids)

    def _release(self, start: int, undecoded: int, final: bool) -> Delta:
        """start: index of this push's first id; undecoded: of the first id not yet decoded
        for good before this push (earlier when a split character was waiting)."""
        cut = first_stop(self.text, self.stop, self._released)
        if cut is not None:
            self.stopped = True
            self._stable, self._tail = self.text[:cut], ""
            del self.ids[max(start, self._ids_through_stop(undecoded)):]  # never un-report ids
            end = cut
        else:
            end = len(self.text) if final else len(self.text) - held_back(self.text, self.stop)
            end = max(end, self._released)
        delta = Delta(tuple(self.ids[start:]), self.text[self._released:end])
        self._released = end
        return delta

    def _ids_through_stop(self, undecoded: int) -> int:
        """How many ids to keep: the fewest whose decoding contains a stop string. Runs once per
        request (at the stop) over the few ids decoded last, so full decodes are affordable."""
        for end in range(undecoded + 1, len(self.ids) + 1):
            if first_stop(self._decode(self.ids[:end]), self.stop, 0) is not None:
                return end
        return len(self.ids)


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
