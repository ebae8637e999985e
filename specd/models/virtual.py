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

from specd.errors import InvalidRequest

WINDOW_TOKENS = 16  # a row's tokens past its first priced at the batch's token cost, up to this many

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


class VirtualDevice:
    """What a KV pool calls around each forward (KVPool.device)."""

    def __init__(self, profile: DeviceProfile):
        self.profile = profile
        self.forwards = 0
        self.waited_s = 0.0  # slept out beyond the CPU's own compute
        self.late_s = 0.0  # the CPU's compute beyond the profile's time (it cannot speed up)

    def finish(self, started: float, widths: Sequence[int]) -> None:
        """Return only once the profile's time for this forward has passed since `started`."""
        self.forwards += 1
        left = started + self.profile.seconds(widths) - time.perf_counter()
        if left > 0:
            time.sleep(left)
            self.waited_s += left
        else:
            self.late_s -= left
