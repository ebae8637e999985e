"""The incremental stop-string cut of specd.detok equals the algorithm it replaced (kept here
as the reference) push for push, on random texts, stop strings and chunkings, and decodes only
O(new ids) per push, however long the generation already is."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from specd.detok import REPLACEMENT_CHAR, Delta, TextStream, first_stop, held_back
from specd.runtime.tiny import char_tokenizer
from tests.services.common.test_detok import _bytes_to_unicode


class ReferenceTextStream:
    """specd.detok.TextStream before it was made incremental, verbatim."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.stopped = False
        self._prefix = 0
        self._read = 0
        self._stable = ""
        self._tail = ""
        self._released = 0

    @property
    def text(self) -> str:
        return self._stable + self._tail

    def push(self, token_ids: Sequence[int]) -> Delta:
        if self.stopped:
            return Delta((), "")
        start, undecoded = len(self.ids), self._read
        self.ids.extend(token_ids)
        self._decode_window(final=False)
        return self._release(start, undecoded, final=False)

    def finish(self) -> Delta:
        if self.stopped:
            return Delta((), "")
        undecoded = self._read
        self._decode_window(final=True)
        return self._release(len(self.ids), undecoded, final=True)

    def _decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _decode_window(self, final: bool) -> None:
        if self._read == len(self.ids):
            return
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        window_text = self._decode(self.ids[self._prefix:])
        new = window_text[len(prefix_text):]
        if new.endswith(REPLACEMENT_CHAR) and not final:
            self._tail = new.rstrip(REPLACEMENT_CHAR)
        elif new or final:
            self._stable += new
            self._tail = ""
            self._prefix, self._read = self._read, len(self.ids)

    def _release(self, start: int, undecoded: int, final: bool) -> Delta:
        cut = first_stop(self.text, self.stop, self._released)
        if cut is not None:
            self.stopped = True
            self._stable, self._tail = self.text[:cut], ""
            del self.ids[max(start, self._ids_through_stop(undecoded)):]
            end = cut
        else:
            end = len(self.text) if final else len(self.text) - held_back(self.text, self.stop)
            end = max(end, self._released)
        delta = Delta(tuple(self.ids[start:]), self.text[self._released:end])
        self._released = end
        return delta

    def _ids_through_stop(self, undecoded: int) -> int:
        for end in range(undecoded + 1, len(self.ids) + 1):
            if first_stop(self._decode(self.ids[:end]), self.stop, 0) is not None:
                return end
        return len(self.ids)


class Counting:
    """A real tokenizer that counts the ids it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


@pytest.fixture(scope="module")
def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def chars():
    return char_tokenizer()


ASCII = "ab \nU:s.xy"
WIDE = ASCII + "é€😀ü"  # two-, three- and four-byte characters, split across byte tokens


def _case(rng: random.Random, alphabet: str) -> tuple[str, tuple[str, ...]]:
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
    stops = []
    for _ in range(rng.randint(0, 3)):
        if text and rng.random() < 0.7:  # a piece of the text: it will be hit
            i = rng.randrange(len(text))
            stops.append(text[i:i + rng.randint(1, 6)])
        else:
            stops.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))))
    if rng.random() < 0.1:
        stops.append("")
    return text, tuple(stops)


def _run(stream, ids: list[int], rng: random.Random) -> list:
    out, i = [], 0
    while i < len(ids):
        n = rng.choice([0, 1, 1, 2, 3, 5, 8, 40])
        d = stream.push(ids[i:i + n])
        out.append(("push", d.token_ids, d.text, stream.stopped))
        i += n
    d = stream.finish()
    out.append(("finish", d.token_ids, d.text, stream.stopped, tuple(stream.ids), stream.text))
    return out


@pytest.mark.parametrize("which, alphabet", [("chars", ASCII), ("byte_tokenizer", WIDE)])
def test_equals_the_reference_on_random_texts(request, which, alphabet):
    tokenizer = request.getfixturevalue(which)
    rng = random.Random(1234)
    stopped = 0
    for _ in range(1500):
        text, stop = _case(rng, alphabet)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        seed = rng.random()
        want = _run(ReferenceTextStream(tokenizer, stop), ids, random.Random(seed))
        got = _run(TextStream(tokenizer, stop), ids, random.Random(seed))
        assert got == want, (text, stop)
        stopped += want[-1][3]
    assert stopped > 500  # most cases hit a stop string, many split across pushes


def test_a_push_decodes_only_its_new_ids(byte_tokenizer):
    """A long generation in many pushes, then a stop string in a large pile-up: the work is
    bounded by the ids pushed, not by the square of the generation's length."""
    counting = Counting(byte_tokenizer)
    stream = TextStream(counting, ("STOP",))
    ids = byte_tokenizer("é" * 4000, add_special_tokens=False)["input_ids"]  # 8000 ids
    for i in range(0, len(ids), 4):
        stream.push(ids[i:i + 4])
    assert counting.decoded < 20 * len(ids)
    counting.decoded = 0
    pile = byte_tokenizer("x" * 5000 + "STOP" + "y" * 100, add_special_tokens=False)["input_ids"]
    delta = stream.push(pile)
    assert stream.stopped and delta.text == "x" * 5000 and len(delta.token_ids) == 5004
    assert counting.decoded < 40 * len(pile)  # a binary search: a few decodes of the pile
