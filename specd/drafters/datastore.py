"""A datastore of the target's own text, searched by suffix (REST, He et al. 2024).

Prompt lookup only finds what this request already said. A datastore holds what the target
said to many other prompts: its greedy answers repeat phrasings across requests ("Here are
some tips", "In conclusion, ..."), so the tokens after the longest match of the current
suffix in that text are a good guess at what it says next.

The text is one int32 array of documents separated by -1. The index is the list of
positions e that have a next token, sorted by the reversed context data[e], data[e-1], ...,
data[e-W+1] (W = `width`). Extending a match one token further back then narrows a
contiguous range of that list, so the longest match is W binary searches, each over the
range the previous one left. Its continuation is the majority path through the matched
occurrences: the most frequent next token, then the most frequent one after it among the
occurrences that agreed, for as long as a majority agrees.

Memory: 4 bytes per token for the text, 4 for the index and 4 for each of the index's W - 1
context columns (a million tokens at W = 8: 36 MB), which make each narrowing a binary search
on a slice rather than a gather over the range first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save_file

from specd.errors import InvalidRequest

SEP = -1
TAIL = 64  # separators after the text: a continuation (at most this long) always meets one
DATA = Path(__file__).resolve().parent.parent / "data"
# Datastores shipped with specd, by target: `specd train-drafter --kind datastore` made them
# (docs/engine.md gives the command); used by the retrieval drafter when none is named.
BUNDLED_DATASTORES = {"smollm2-135m-instruct": DATA / "smollm2-datastore.safetensors"}
MAX_VOTERS = 4096  # majorities over more occurrences than this are taken on an even subsample
FEW = 32  # a Walk over this many occurrences or fewer narrows them in plain Python


def voters(ends: np.ndarray) -> np.ndarray:
    """The occurrences a majority is taken over: all of them, or an even subsample of MAX_VOTERS."""
    return ends[:: -(-ends.size // MAX_VOTERS)] if ends.size > MAX_VOTERS else ends


def bundled_datastore_path(target_name: str) -> Path | None:
    path = BUNDLED_DATASTORES.get(target_name)
    return path if path is not None and path.is_file() else None


class Walk:
    """The occurrences of a match in a token text (a request's own, or a datastore's), narrowed
    token by token to those whose text agrees with what was handed out; the n-gram drafters
    hand out a proposal this way, one token per call, with the votes behind each.

    Each next token is chosen among what the surviving occurrences go on with:
      - "recent": what the most recent occurrence says (prompt lookup's copy of one passage);
      - "majority": the most frequent, while more than half of them agree after the first
        (the datastore's majority path, `Datastore.continuation`);
      - "race": for coupled sampling, the candidate v with the largest count(v) / E(v), E the
        request's race noise at this position (specd.sampling): the token the target draws is
        argmax p / E, so a candidate the noise favours is the likelier winner. Any choice is
        lossless there (verification accepts only the target's own draw).
    """

    __slots__ = ("text", "alive", "j", "rule", "limit")

    def __init__(self, text: np.ndarray, ends: np.ndarray, rule: str, limit: int):
        self.text, self.rule, self.limit, self.j = text, rule, limit, 0
        self.alive: np.ndarray | list[int] = ends.tolist() if ends.size <= FEW else ends

    def next(self, noise: np.ndarray | None) -> tuple[int, int, float] | None:
        """(token, votes, support), or None when no occurrence goes on; `noise`: this position's
        race noise, which the "race" rule needs."""
        if self.j >= self.limit:
            return None
        if isinstance(self.alive, list):
            return self._next_few(noise)
        text = self.text
        alive = self.alive[self.alive + 1 + self.j < len(text)]  # own text: the continuation reaches its end
        column = text[alive + 1 + self.j]
        valid = column[column >= 0]  # a datastore document ends
        if valid.size == 0:
            return None
        if self.rule == "recent":
            token = int(valid[-1])
            count = int((valid == token).sum())
        else:
            values, counts = np.unique(valid, return_counts=True)
            best = int((counts / noise[values]).argmax()) if self.rule == "race" else int(counts.argmax())
            token, count = int(values[best]), int(counts[best])
            if self.rule == "majority" and self.j > 0 and 2 * count <= alive.size:
                return None  # the majority path ends
        alive = alive[column == token]
        self.alive = alive.tolist() if alive.size <= FEW else alive
        self.j += 1
        return token, int(valid.size), count / valid.size

    def _next_few(self, noise: np.ndarray | None) -> tuple[int, int, float] | None:
        """`next` over at most FEW occurrences, in plain Python, where numpy's per-call cost was
        most of a drafted token's: the same choices (ties go to the smallest token, as in
        np.unique's order)."""
        text, offset = self.text, 1 + self.j
        end = len(text) - offset
        alive = [e for e in self.alive if e < end]
        if len(alive) <= 8:
            item = text.item
            column = [item(e + offset) for e in alive]
        else:
            column = text[np.asarray(alive) + offset].tolist()
        valid = [c for c in column if c >= 0]
        if not valid:
            return None
        if self.rule == "recent":
            token = valid[-1]
            count = valid.count(token)
        else:
            counts: dict[int, int] = {}
            for c in valid:
                counts[c] = counts.get(c, 0) + 1
            if len(counts) == 1:
                ((token, count),) = counts.items()
            else:
                values = sorted(counts)
                if self.rule == "race":
                    token = max(values, key=lambda v: counts[v] / float(noise[v]))
                else:
                    token = max(values, key=counts.__getitem__)
                count = counts[token]
            if self.rule == "majority" and self.j > 0 and 2 * count <= len(alive):
                return None  # the majority path ends
        self.alive = [e for e, c in zip(alive, column) if c == token]
        self.j += 1
        return token, len(valid), count / len(valid)


class Datastore:
    def __init__(self, tokens: np.ndarray, width: int = 8, meta: dict[str, str] | None = None):
        if width < 1:
            raise InvalidRequest("width", f"must be at least 1, got {width}")
        tokens = np.asarray(tokens, dtype=np.int32)
        if tokens.ndim != 1 or (tokens.size and int(tokens.min()) < SEP):
            raise InvalidRequest("datastore", "tokens must be one array of ids >= 0 separated by -1")
        self.width = width
        self.meta = dict(meta or {})
        self.documents = int((tokens == SEP).sum()) + (1 if tokens.size and tokens[-1] != SEP else 0)
        # width separators in front (a context never reaches before the text), TAIL behind
        self.data = np.concatenate([np.full(width, SEP, np.int32), tokens, np.full(TAIL, SEP, np.int32)])
        ends = np.flatnonzero((self.data[:-1] >= 0) & (self.data[1:] >= 0))
        keys = [self.data[ends - j] for j in range(width - 1, -1, -1)]  # lexsort: last key is primary
        self.index = ends[np.lexsort(keys)].astype(np.int32) if ends.size else ends.astype(np.int32)
        # where each last token's block of the index starts: the first narrowing is a lookup
        first = self.data[self.index]
        self.vocab = int(first.max()) + 1 if first.size else 0
        self.starts = np.searchsorted(first, np.arange(self.vocab + 1)).astype(np.int64)
        # columns[j - 1][i]: the token j places before the end index[i] (the sort's j-th key)
        self.columns = [self.data[self.index - j] for j in range(1, width)]

    @classmethod
    def from_documents(cls, docs: Iterable[Sequence[int]], width: int = 8,
                       meta: dict[str, str] | None = None) -> Datastore:
        parts = []
        for doc in docs:
            if len(doc):
                parts.append(np.asarray(doc, dtype=np.int32))
                parts.append(np.array([SEP], np.int32))
        return cls(np.concatenate(parts) if parts else np.zeros(0, np.int32), width, meta)

    @property
    def tokens(self) -> int:
        """Text tokens held (separators not counted)."""
        return int((self.data >= 0).sum())

    # -- files ---------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        body = self.data[self.width:len(self.data) - TAIL]
        meta = {k: str(v) for k, v in self.meta.items()} | {"width": str(self.width)}
        save_file({"tokens": np.ascontiguousarray(body)}, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path, vocab_size: int | None = None) -> Datastore:
        path = Path(path)
        if not path.is_file():
            raise InvalidRequest("datastore", f"no datastore file at {path}")
        try:
            tensors = load_file(str(path))
            with safe_open(str(path), "np") as f:
                meta = dict(f.metadata() or {})
            tokens = tensors["tokens"]
        except (SafetensorError, OSError, KeyError) as exc:  # not a datastore: one clear line
            raise InvalidRequest("datastore", f"{path} is not a datastore ({exc})") from None
        if vocab_size is not None and tokens.size and int(tokens.max()) >= vocab_size:
            raise InvalidRequest("datastore", f"{path} holds token ids up to {int(tokens.max())}, beyond this "
                                              f"target's vocabulary of {vocab_size}: built for another tokenizer")
        return cls(tokens, int(meta.get("width", 8)), meta)

    # -- lookup --------------------------------------------------------------------------------
    def match(self, context: np.ndarray) -> tuple[np.ndarray, int]:
        """(positions where the longest matched suffix of context ends, its length), capped at
        `width` tokens; (empty, 0) when not even the last token occurs with a continuation."""
        if not len(context) or not 0 <= context[-1] < self.vocab:
            return self.index[:0], 0
        last = int(context[-1])
        lo, hi, length = int(self.starts[last]), int(self.starts[last + 1]), 1
        if lo == hi:
            return self.index[:0], 0
        for j in range(1, min(self.width, len(context))):
            column = self.columns[j - 1][lo:hi]  # sorted: earlier columns are equal in the range
            want = int(context[len(context) - 1 - j])
            a, b = column.searchsorted((want, want + 1)).tolist()  # integers: want's right edge is want + 1's left
            if a == b:
                break
            lo, hi, length = lo + a, lo + b, j + 1
        return self.index[lo:hi], length

    def continuation(self, ends: np.ndarray, max_len: int) -> list[int]:
        """The majority path after the occurrences ending at `ends`: the most frequent next
        token, then among the occurrences that agreed the most frequent one after it, while
        more than half agree (the first token needs only to be the most frequent)."""
        walk, out = Walk(self.data, voters(ends), "majority", min(max_len, TAIL)), []
        while (got := walk.next(None)) is not None:
            out.append(got[0])
        return out

    def alternatives(self, ends: np.ndarray, count: int, max_len: int) -> list[list[int]]:
        """Up to `count` continuations after the occurrences ending at `ends`, one per next
        token, most frequent first, each followed by its own majority path (a draft tree's
        branches)."""
        ends = voters(ends)
        column = self.data[ends + 1]
        values, counts = np.unique(column[column >= 0], return_counts=True)
        out = []
        for i in np.argsort(-counts, kind="stable")[:count]:
            token = int(values[i])
            out.append([token] + self.continuation(ends[column == token] + 1, max_len - 1))
        return out

    def lookup(self, context: np.ndarray, max_len: int) -> tuple[list[int], int]:
        """(proposed continuation, match length) for the text so far."""
        ends, length = self.match(context)
        return (self.continuation(ends, max_len) if length else []), length
