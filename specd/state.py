"""Shared adaptive policy state (thresholds, running means, the heuristic's K).

The state persists across requests and is keyed by (draft model, target model, policy,
task tag) so that every request of a kind of traffic starts from what earlier ones learned.
This module holds the interface and the in-memory backend used when no Redis is
configured; the Redis backend lives with the services and implements the same protocol.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
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


class StateStore(Protocol):
    def load(self, key: StateKey) -> dict[str, float]:
        """The saved state, or {} when nothing was saved yet."""

    def save(self, key: StateKey, state: dict[str, float]) -> None:
        """Replace the saved state (last writer wins)."""


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
            self._data[key] = dict(state)
            self._data.move_to_end(key)
            while len(self._data) > self.max_keys:
                self._data.popitem(last=False)
