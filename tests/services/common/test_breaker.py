"""The circuit breaker: closed until a failure, open for the cool-down, then one probe."""

from __future__ import annotations

import pytest

from services.common.breaker import Breaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_failure_skips_for_the_cool_down_then_one_caller_probes():
    clock = Clock()
    b = Breaker(5.0, clock)
    assert b.allow() and not b.is_open
    b.failure()
    assert b.is_open and not b.allow()
    clock.now += 4.9
    assert not b.allow()
    clock.now += 0.2
    assert b.allow()  # the probe
    assert not b.allow()  # everyone else waits for it
    b.failure()  # the probe failed: another cool-down
    clock.now += 4.9
    assert not b.allow()
    clock.now += 0.2
    assert b.allow()
    b.success()
    assert not b.is_open and b.allow() and b.allow()


def test_zero_cool_down_always_allows_and_negative_is_refused():
    b = Breaker(0.0, Clock())
    b.failure()
    assert b.allow() and b.allow()
    with pytest.raises(ValueError):
        Breaker(-1)
