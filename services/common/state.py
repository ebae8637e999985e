"""Async stores of the adaptive policy state (specd.state), shared by coordinator replicas.

Redis layout (one hash per StateKey):

    key:    {namespace}:v1:policy-state:{draft}|{target}|{policy}|{task_tag}
    fields: state names (e.g. "threshold", "k")
    values: floats written with repr() (exact round trip, "inf"/"nan" included),
            read back with float()

`namespace` defaults to "specd"; "v1" is the version of this layout. Each of the four key
parts is escaped so that "|" stays a separator: "%" becomes "%25", then "|" becomes "%7C";
every other character (":" and "/" of model names included) is kept as is. A save replaces the
whole hash atomically (MULTI/EXEC: DEL, then HSET); saving an empty state only DELs it. Last
writer wins; nothing expires.

Redis being unreachable (connection refused, DNS, socket timeout) raises
specd.errors.Unavailable naming the URL without its password; callers decide whether to go on
without shared state. `build_state_store(None)` gives the process-local memory store.
"""

from __future__ import annotations

from typing import Protocol
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from specd.errors import Unavailable
from specd.state import MemoryStateStore, StateKey


class AsyncStateStore(Protocol):
    async def load(self, key: StateKey) -> dict[str, float]:
        """The saved state, or {} when nothing was saved yet."""

    async def save(self, key: StateKey, state: dict[str, float]) -> None:
        """Replace the saved state (last writer wins)."""

    async def close(self) -> None:
        """Release connections; the store is not used afterwards."""


class AsyncMemoryStateStore:
    """Process-local AsyncStateStore over specd.state.MemoryStateStore (no Redis configured)."""

    def __init__(self, store: MemoryStateStore | None = None) -> None:
        self._store = store if store is not None else MemoryStateStore()

    async def load(self, key: StateKey) -> dict[str, float]:
        return self._store.load(key)

    async def save(self, key: StateKey, state: dict[str, float]) -> None:
        self._store.save(key, state)

    async def ping(self) -> None:
        """Always healthy: nothing remote to reach."""

    async def close(self) -> None:
        pass


def _escape(part: str) -> str:
    return part.replace("%", "%25").replace("|", "%7C")


def redact_url(url: str) -> str:
    """`url` with any password replaced by "***" (for messages and logs)."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user = parts.username or ""
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        port = f":{parts.port}" if parts.port is not None else ""
        return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))
    except ValueError:  # unparsable: say nothing of it rather than leak a secret
        return "<redis url>"


class RedisStateStore:
    """AsyncStateStore on Redis, shared by every replica that uses the same URL and namespace."""

    def __init__(self, url: str, namespace: str = "specd", *, timeout_s: float = 2.0,
                 retries: int = 1) -> None:
        if not namespace:
            raise ValueError("namespace must not be empty")
        self.url = url
        self.namespace = namespace
        self._safe_url = redact_url(url)
        try:
            self._redis = aioredis.Redis.from_url(
                url,
                decode_responses=True,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                # A dropped connection is retried once, briefly; an unreachable server fails fast.
                retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), retries),
            )
        except ValueError as e:  # a malformed URL is a configuration error, not an outage
            raise ValueError(f"invalid Redis URL {self._safe_url}: {e}") from None

    def key(self, key: StateKey) -> str:
        """The Redis key holding `key`'s state (see the module docstring)."""
        parts = "|".join(_escape(p) for p in (key.draft, key.target, key.policy, key.task_tag))
        return f"{self.namespace}:v1:policy-state:{parts}"

    def _unavailable(self, e: Exception) -> Unavailable:
        return Unavailable(f"shared policy state: Redis at {self._safe_url} is unreachable: "
                           f"{type(e).__name__}: {e}")

    async def load(self, key: StateKey) -> dict[str, float]:
        try:
            raw = await self._redis.hgetall(self.key(key))
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as e:
            raise self._unavailable(e) from e
        return {name: float(value) for name, value in raw.items()}

    async def save(self, key: StateKey, state: dict[str, float]) -> None:
        k = self.key(key)
        mapping = {name: repr(float(value)) for name, value in state.items()}
        try:
            if not mapping:
                await self._redis.delete(k)
                return
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(k)
                pipe.hset(k, mapping=mapping)
                await pipe.execute()
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as e:
            raise self._unavailable(e) from e

    async def ping(self) -> None:
        """Returns when Redis answers; raises Unavailable otherwise (for health checks)."""
        try:
            await self._redis.ping()
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as e:
            raise self._unavailable(e) from e

    async def close(self) -> None:
        await self._redis.aclose()


def build_state_store(redis_url: str | None, namespace: str = "specd") -> AsyncStateStore:
    """Redis when a URL is given, else the process-local memory store."""
    if redis_url:
        return RedisStateStore(redis_url, namespace)
    return AsyncMemoryStateStore()
