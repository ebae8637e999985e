"""Shared adaptive policy state (thresholds, running means, the heuristic's K).

The state persists across requests and is keyed by (draft model, target model, policy,
task tag) so that every request of a kind of traffic starts from what earlier ones learned.
This module holds the interface and the in-memory backend used when no Redis is
configured; the Redis backend lives with the services and implements the same protocol.

Requests of one key run side by side, so a request that ends has to fold what it learned
into what the others saved meanwhile (`StateUpdate`). A policy whose state is decayed sums
(cost-aware's calibration table) says by how much its request decayed each sum; the store
then applies the request's own observations on top of the stored sums, as if the requests had
run one after another. Any other field is a value, and the last request to end writes it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class StateKey:
    draft: str
    target: str
    policy: str
    task_tag: str = "default"

    def __str__(self) -> str:
        return f"{self.draft}|{self.target}|{self.policy}|{self.task_tag}"


@dataclass(frozen=True)
class StateUpdate:
    """What one request changes in a saved state.

    sums: field -> (scale, add). The field is a decayed sum; the request multiplied the value it
    loaded by `scale` (its decay) and added `add` (its own observations, decayed as they came).
    The store's current value v becomes v * scale + add: with no other writer that is exactly
    the request's final value, and with others it keeps their observations too.
    values: field -> value, written as they are (the last request to end wins).
    replace: the request's state replaces the saved one whole (a policy with no decayed sums).
    """

    sums: Mapping[str, tuple[float, float]]
    values: Mapping[str, float]
    replace: bool

    @classmethod
    def between(cls, start: Mapping[str, float], end: Mapping[str, float],
                scale: Mapping[str, float]) -> "StateUpdate":
        """The update of a request that loaded `start`, ended with `end`, and decayed each field
        of `scale` by that factor. No scales: the end state replaces the saved one."""
        if not scale:
            return cls({}, dict(end), True)
        sums = {k: (scale[k], v - scale[k] * start.get(k, 0.0)) for k, v in end.items() if k in scale}
        return cls(sums, {k: v for k, v in end.items() if k not in scale}, False)

    def apply(self, stored: Mapping[str, float]) -> dict[str, float]:
        """The state to save where `stored` is saved now."""
        if self.replace:
            return dict(self.values)
        out = dict(stored)
        for k, (scale, add) in self.sums.items():
            out[k] = stored.get(k, 0.0) * scale + add
        out.update(self.values)
        return out


class StateStore(Protocol):
    def load(self, key: StateKey) -> dict[str, float]:
        """The saved state, or {} when nothing was saved yet."""

    def save(self, key: StateKey, state: dict[str, float]) -> None:
        """Replace the saved state (last writer wins)."""

    def update(self, key: StateKey, update: StateUpdate) -> None:
        """Fold one request's update into the saved state, atomically."""


MAX_KEYS = 10_000  # states one process keeps: task tags come from clients, so they are bounded


class MemoryStateStore:
    """Process-local StateStore; thread-safe. An LRU of at most max_keys states, so that clients
    sending ever new task tags cannot grow the process: the least recently used state is
    dropped (its next request starts from the policy's defaults)."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be at least 1")
        self.max_keys = max_keys
        self._data: OrderedDict[StateKey, dict[str, float]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._data)

    def load(self, key: StateKey) -> dict[str, float]:
        with self._lock:
            state = self._data.get(key)
            if state is None:
                return {}
            self._data.move_to_end(key)
            return dict(state)

    def save(self, key: StateKey, state: dict[str, float]) -> None:
        with self._lock:
            if not state:
                self._data.pop(key, None)
                return
            self._put(key, dict(state))

    def update(self, key: StateKey, update: StateUpdate) -> None:
        with self._lock:
            state = update.apply(self._data.get(key, {}))
            if state:
                self._put(key, state)
            else:
                self._data.pop(key, None)

    def _put(self, key: StateKey, state: dict[str, float]) -> None:
        self._data[key] = state
        self._data.move_to_end(key)
        while len(self._data) > self.max_keys:
            self._data.popitem(last=False)
