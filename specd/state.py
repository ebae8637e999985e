"""Shared adaptive policy state (thresholds, running means, the heuristic's K).

The state persists across requests and is keyed by (draft model, target model, policy,
task tag) so that every request of a kind of traffic starts from what earlier ones learned.
This module holds the interface and the in-memory backend used when no Redis is
configured; the Redis backend lives with the services and implements the same protocol.
"""

from __future__ import annotations

import threading
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


class MemoryStateStore:
    """Process-local StateStore; thread-safe."""

    def __init__(self) -> None:
        self._data: dict[StateKey, dict[str, float]] = {}
        self._lock = threading.Lock()

    def load(self, key: StateKey) -> dict[str, float]:
        with self._lock:
            return dict(self._data.get(key, {}))

    def save(self, key: StateKey, state: dict[str, float]) -> None:
        with self._lock:
            self._data[key] = dict(state)
