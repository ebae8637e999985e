"""A small circuit breaker for an optional dependency (the Redis policy-state store, the draft
service): after a failure the dependency is skipped for `cooldown_s`, so a dead or slow one
costs one short failure per cool-down rather than a wait on every request.

    closed (allow)  --failure()-->  open for cooldown_s (refuse)
    open, cool-down over: one caller is allowed to probe (and the cool-down starts again for
    everyone else); its success() closes the breaker, its failure() opens it for another round.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Breaker:
    def __init__(self, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if cooldown_s < 0:
            raise ValueError("cooldown_s must be >= 0")
        self.cooldown_s, self._clock = cooldown_s, clock
        self._open_until: float | None = None

    @property
    def is_open(self) -> bool:
        """True while calls are being skipped (a probe may be under way)."""
        return self._open_until is not None

    def allow(self) -> bool:
        """Whether to call the dependency now; False during a cool-down."""
        if self._open_until is None:
            return True
        now = self._clock()
        if now < self._open_until:
            return False
        self._open_until = now + self.cooldown_s  # this caller probes; the others wait for it
        return True

    def success(self) -> None:
        self._open_until = None

    def failure(self) -> None:
        self._open_until = self._clock() + self.cooldown_s
