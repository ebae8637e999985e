"""A virtual device: a KV pool whose forwards take the time a measured device takes, for
benchmarks and tests on a machine without that device (`specd serve target --virtual-device
FILE`).

A (tiny, real) model computes every forward on the CPU as usual; the forward then returns no
sooner than the profile's time for its shape after it started, sleeping out the rest (the GIL
released, so the host's other threads run meanwhile, as they would while a GPU computes).
The host sees what it sees on that device today, where it reads each forward's verdicts
before it goes on: a forward's results are readable only once the device is done with it.

The profile is a device's cost surface as the target service measures it at start-up
(bench-load's results.json keeps it as `target_costs`): the seconds of a forward of B sessions
x 1 token (`batch_s`), of each further token in it (`batch_token_s`), and of one session's
window of n tokens (`verify_s`), whose slope prices tokens past a window (prefill chunks).

A replay (`--virtual-replay FILE`) gives the tiny model a real model's answers, so that drafts
are kept as often as they would be with that model: where a logits row's context (its position
and the 16 tokens up to it) is one of the recorded prompts and answers, the row is rewritten to
put the recorded next token first, by far; elsewhere (a context no answer had: after a rejected
draft, or another prompt) the tiny model's own row stands. The recording is the embedded
target's greedy answers (`scripts/draft_cost.py --answers FILE`, which prices the same answers'
rounds on a cost curve: the replay's prediction), and the tiny model must share its tokenizer
(`specd.runtime.tiny.save_tiny(..., tokenizer=...)`). Draft-tree rows are not replayed.

What it cannot model: the host's own speed (the host here is this machine's), a kernel's launch
cost or a copy's, and memory: it slows forwards down to the device, never speeds them up, so a
model whose CPU forward outlasts the profile runs at the CPU's pace.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specd.errors import InvalidRequest

WINDOW_TOKENS = 16  # a row's tokens past its first priced at the batch's token cost, up to this many
REPLAY_CONTEXT = 16  # a replayed row's context: its position and this many tokens up to it
REPLAY_LOGIT = 50.0  # a replayed row: this for the recorded token, 0 for every other

FIELD = "virtual_device"


@dataclass(frozen=True)
class DeviceProfile:
    batch_s: tuple[float, ...]  # [B - 1]: a forward of B sessions x 1 token
    batch_token_s: tuple[float, ...]  # [B - 1]: each further token in such a forward
    verify_s: tuple[float, ...]  # [n - 1]: one session's forward of n tokens
    name: str = ""

    @classmethod
    def load(cls, path: str | Path) -> DeviceProfile:
        """From a bench-load results.json (its target_costs) or a JSON of those three lists."""
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise InvalidRequest(FIELD, f"cannot read a device profile from {path}: {e}") from None
        costs = doc.get("target_costs", doc) if isinstance(doc, dict) else None
        try:
            profile = cls(tuple(map(float, costs["batch_s"])), tuple(map(float, costs["batch_token_s"])),
                          tuple(map(float, costs["verify_s"])), str(doc.get("machine", path)))
        except (KeyError, TypeError, ValueError):
            raise InvalidRequest(FIELD, f"{path} holds no batch_s, batch_token_s and verify_s lists "
                                        "(bench-load's target_costs)") from None
        if not profile.batch_s or len(profile.batch_token_s) != len(profile.batch_s) or len(profile.verify_s) < 2 \
                or min(profile.batch_s + profile.batch_token_s + profile.verify_s) < 0:
            raise InvalidRequest(FIELD, f"{path}: batch_s and batch_token_s of one length, verify_s of two or more, "
                                        "no negative seconds")
        return profile

    def seconds(self, widths: Sequence[int]) -> float:
        """A forward of sessions with these numbers of new tokens each."""
        b = len(widths)
        step, token = self._at(self.batch_s, b), self._at(self.batch_token_s, b)
        prefill = (self.verify_s[-1] - self.verify_s[0]) / (len(self.verify_s) - 1)
        extra = sum(min(w - 1, WINDOW_TOKENS) * token + max(w - 1 - WINDOW_TOKENS, 0) * prefill for w in widths)
        return step + extra

    @staticmethod
    def _at(values: tuple[float, ...], b: int) -> float:
        """values[b - 1], extrapolated along the last two points past the end."""
        if b <= len(values):
            return values[b - 1]
        slope = values[-1] - values[-2] if len(values) > 1 else 0.0
        return values[-1] + slope * (b - len(values))


class Replay:
    """Recorded answers that a virtual device's logits follow (the module's docstring). It keeps
    each KV slot's tokens, as the pool's forwards and prefix copies write them."""

    def __init__(self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]):
        self.next: dict[tuple[int, tuple[int, ...]], int] = {}  # (position, context) -> the token after it
        for prompt, answer in sequences:
            seq = [*prompt, *answer]
            for p in range(len(prompt) - 1, len(seq) - 1):
                self.next[p, tuple(seq[max(0, p + 1 - REPLAY_CONTEXT):p + 1])] = seq[p + 1]
        self.tokens: dict[int, list[int]] = {}  # slot -> the tokens its positions hold (-1: unknown)
        self.replayed = self.own = 0  # logits rows rewritten, and left the model's own

    @classmethod
    def load(cls, path: str | Path) -> Replay:
        """From draft_cost.py's answers file: its prompts and the greedy answers to them."""
        try:
            doc = json.loads(Path(path).read_text())
            return cls(list(zip(doc["prompts"], doc["greedy"], strict=True)))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InvalidRequest("virtual_replay", f"cannot read recorded prompts and greedy answers from {path} "
                                                   f"(scripts/draft_cost.py --answers): {e}") from None

    def copied(self, src: int, dst: int, n: int) -> None:
        self.tokens[dst] = self.tokens.get(src, [])[:n]

    def rewrite(self, rows: Sequence, out: Sequence[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """Each chain row's logits where its context was recorded (rows: the forward's PoolRows)."""
        for r, (logits, _) in zip(rows, out):
            seq = self.tokens.setdefault(r.slot, [])
            del seq[r.start:]
            seq.extend([-1] * (r.start - len(seq)))
            seq.extend(r.ids)
            if r.mask is not None:  # a draft tree's rows: not in tree order here
                self.own += r.num_logits
                continue
            first = len(seq) - r.num_logits  # the position whose next token the first row predicts
            for j in range(r.num_logits):
                p = first + j
                token = self.next.get((p, tuple(seq[max(0, p + 1 - REPLAY_CONTEXT):p + 1])))
                if token is None:
                    self.own += 1
                    continue
                self.replayed += 1
                logits[j].zero_()
                logits[j, token] = REPLAY_LOGIT


class VirtualDevice:
    """What a KV pool calls around each forward (KVPool.virtual)."""

    def __init__(self, profile: DeviceProfile, replay: Replay | None = None):
        self.profile, self.replay = profile, replay
        self.forwards = 0
        self.waited_s = 0.0  # slept out beyond the CPU's own compute
        self.late_s = 0.0  # the CPU's compute beyond the profile's time (it cannot speed up)

    def copied(self, src: int, dst: int, n: int) -> None:
        """The pool copied slot src's first n positions into slot dst."""
        if self.replay is not None:
            self.replay.copied(src, dst, n)

    def finish(self, started: float, rows: Sequence, out: Sequence[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """The forward's logits replayed (if recorded); return only once the profile's time for
        this forward has passed since `started`."""
        if self.replay is not None:
            self.replay.rewrite(rows, out)
        self.forwards += 1
        left = started + self.profile.seconds([len(r.ids) for r in rows]) - time.perf_counter()
        if left > 0:
            time.sleep(left)
            self.waited_s += left
        else:
            self.late_s -= left
