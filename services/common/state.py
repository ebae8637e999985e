"""Async stores of the adaptive policy state (specd.state), shared by coordinator replicas.

Redis layout (one hash per StateKey):

    key:    {namespace}:v1:policy-state:{draft}|{target}|{policy}|{task_tag}
    fields: state names (e.g. "threshold", "k")
    values: floats written with repr() (exact round trip, "inf"/"nan" included),
            read back with float()

`namespace` defaults to "specd"; "v1" is the version of this layout. Each of the four key
parts is escaped so that "|" stays a separator: "%" becomes "%25", then "|" becomes "%7C";
every other character (":" and "/" of model names included) is kept as is. A save replaces the
whole hash atomically (MULTI/EXEC: DEL, HSET, EXPIRE); saving an empty state only DELs it. Last
writer wins. A request's end is an update instead (specd.state.StateUpdate): one Lua script
folds its decayed sums into the hash's current values (v * scale + add, written with
"%.17g", which float() reads back exactly) and writes its other fields, so that requests of
one key that run at once, on one replica or many, all keep what they learned; a policy
with no decayed sums replaces the hash as a save does. Each key expires STATE_TTL_S (30 days) after its last save, so the state of a
pair, policy or task tag no longer served does not stay forever.

Policy state is an optimisation, so Redis can never cost an answer: load() and save() never
raise. Any Redis error (unreachable, timeout, READONLY after a failover, OOM, NOREPLICAS,
LOADING...) is logged as a warning and the request goes on without shared state (load gives
{}, save is dropped); a corrupt value (a field that is not a float, a key that is not a hash)
also loads as {} with a warning, and the next save replaces it. The socket timeouts are short
(DEFAULT_TIMEOUT_S) and a circuit breaker (services.common.breaker) skips Redis for
COOLDOWN_S after a failure (then one request tries again), so a slow or dead Redis costs at
most one short timeout per cool-down. Messages name the URL without its password; ping()
(for health checks) raises specd.errors.Unavailable. `build_state_store(None)` gives the
process-local memory store.
"""

from __future__ import annotations

import logging
from typing import Protocol
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from services.common.breaker import Breaker
from specd.errors import SpecdError, Unavailable
from specd.state import MemoryStateStore, StateKey, StateUpdate

log = logging.getLogger(__name__)


class AsyncStateStore(Protocol):
    async def load(self, key: StateKey) -> dict[str, float]:
        """The saved state, or {} when nothing was saved yet (or it cannot be read)."""

    async def save(self, key: StateKey, state: dict[str, float]) -> None:
        """Replace the saved state (last writer wins); best effort."""

    async def update(self, key: StateKey, update: StateUpdate) -> None:
        """Fold one request's update into the saved state, atomically; best effort."""

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

    async def update(self, key: StateKey, update: StateUpdate) -> None:
        self._store.update(key, update)

    async def ping(self) -> None:
        """Always healthy: nothing remote to reach."""

    async def close(self) -> None:
        pass


def _escape(part: str) -> str:
    return part.replace("%", "%25").replace("|", "%7C")


_SECRET_QUERY = frozenset({"password"})  # redis-py's query arguments that hold a secret


def has_password(url: str) -> bool:
    """Whether a Redis URL holds a password (in its userinfo or a `password=` query argument)."""
    try:
        parts = urlsplit(url)
        return parts.password is not None or any(k.lower() in _SECRET_QUERY for k, _ in parse_qsl(parts.query))
    except ValueError:
        return True  # unparsable: treat it as a secret


def redact_url(url: str) -> str:
    """`url` with any password (userinfo or `password=` query argument) replaced by "***", for
    messages and logs."""
    try:
        parts = urlsplit(url)
        if parts.password is not None:
            user = parts.username or ""
            host = parts.hostname or ""
            if ":" in host:
                host = f"[{host}]"
            port = f":{parts.port}" if parts.port is not None else ""
            parts = parts._replace(netloc=f"{user}:***@{host}{port}")
        query = parse_qsl(parts.query, keep_blank_values=True)
        if any(k.lower() in _SECRET_QUERY for k, _ in query):
            hidden = [(k, "***" if k.lower() in _SECRET_QUERY else v) for k, v in query]
            parts = parts._replace(query=urlencode(hidden, safe="*"))
        return urlunsplit(parts)
    except ValueError:  # unparsable: say nothing of it rather than leak a secret
        return "<redis url>"


# What a Redis call raises when Redis is down, slow or refuses (READONLY, OOM, LOADING...).
REDIS_ERRORS = (redis.exceptions.RedisError, OSError)


def redis_client(url: str, timeout_s: float, retries: int = 1) -> aioredis.Redis:
    """A client that fails fast: a dropped connection (Redis restarted) is retried `retries`
    times at once, a timeout is not retried (a slow Redis costs one timeout). A malformed URL is
    a configuration error (SpecdError, the password redacted), not an outage."""
    try:
        return aioredis.Redis.from_url(
            url, decode_responses=True, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), retries, supported_errors=(redis.exceptions.ConnectionError,)))
    except ValueError as e:
        raise SpecdError(f"invalid Redis URL {redact_url(url)}: {e}") from None


# KEYS[1] the hash; ARGV: the TTL, the number of sums, then (field, scale, add) per sum, then
# (field, value) per value. A field that is missing or not a number counts as 0.
_UPDATE = """
local n = tonumber(ARGV[2])
local i = 3
for _ = 1, n do
  local now = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0') or 0
  redis.call('HSET', KEYS[1], ARGV[i], string.format('%.17g', now * tonumber(ARGV[i + 1]) + tonumber(ARGV[i + 2])))
  i = i + 3
end
while i < #ARGV do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  i = i + 2
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
"""

STATE_TTL_S = 30 * 24 * 3600  # a policy-state key expires this long after its last save
DEFAULT_TIMEOUT_S = 0.5  # connect and read timeout of one Redis command
COOLDOWN_S = 5.0  # after a Redis failure, skip Redis this long


class RedisStateStore:
    """AsyncStateStore on Redis, shared by every replica that uses the same URL and namespace."""

    def __init__(self, url: str, namespace: str = "specd", *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 retries: int = 1, ttl_s: int = STATE_TTL_S, cooldown_s: float = COOLDOWN_S) -> None:
        if not namespace:
            raise ValueError("namespace must not be empty")
        if ttl_s < 1:
            raise ValueError("ttl_s must be at least 1 second")
        self.url = url
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.breaker = Breaker(cooldown_s)
        self._safe_url = redact_url(url)
        self._redis = redis_client(url, timeout_s, retries)  # a slow Redis: one timeout, then the breaker

    def key(self, key: StateKey) -> str:
        """The Redis key holding `key`'s state (see the module docstring)."""
        parts = "|".join(_escape(p) for p in (key.draft, key.target, key.policy, key.task_tag))
        return f"{self.namespace}:v1:policy-state:{parts}"

    def _unavailable(self, e: Exception) -> Unavailable:
        return Unavailable(f"shared policy state: Redis at {self._safe_url} is unreachable: "
                           f"{type(e).__name__}: {e}")

    def _failed(self, what: str, e: Exception) -> None:
        """A Redis failure: warn, and skip Redis for the cool-down."""
        self.breaker.failure()
        log.warning("shared policy state: %s on Redis at %s failed (%s: %s); going on without it, "
                    "Redis skipped for %.0f s", what, self._safe_url, type(e).__name__, e, self.breaker.cooldown_s)

    async def load(self, key: StateKey) -> dict[str, float]:
        """The saved state; {} when nothing is saved, the value is corrupt or Redis fails."""
        if not self.breaker.allow():
            return {}
        k = self.key(key)
        try:
            raw = await self._redis.hgetall(k)
        except redis.exceptions.ResponseError as e:
            if not str(e).startswith("WRONGTYPE"):
                self._failed("load", e)
                return {}
            self.breaker.success()  # Redis answered: only this key is wrong
            log.warning("shared policy state: %s is not a hash; starting from the policy's defaults", k)
            return {}
        except REDIS_ERRORS as e:
            self._failed("load", e)
            return {}
        self.breaker.success()
        try:
            return {name: float(value) for name, value in raw.items()}
        except (TypeError, ValueError) as e:
            log.warning("shared policy state: %s holds a value that is not a float (%s); starting from "
                        "the policy's defaults", k, e)
            return {}

    async def save(self, key: StateKey, state: dict[str, float]) -> None:
        """Replace the saved state; dropped (with a warning) when Redis fails."""
        if not self.breaker.allow():
            return
        k = self.key(key)
        mapping = {name: repr(float(value)) for name, value in state.items()}
        try:
            if not mapping:
                await self._redis.delete(k)
            else:
                async with self._redis.pipeline(transaction=True) as pipe:
                    pipe.delete(k)  # also replaces a key of the wrong type
                    pipe.hset(k, mapping=mapping)
                    pipe.expire(k, self.ttl_s)
                    await pipe.execute()
        except REDIS_ERRORS as e:
            self._failed("save", e)
            return
        self.breaker.success()

    async def update(self, key: StateKey, update: StateUpdate) -> None:
        """Fold one request's update into the saved state (the module docstring); dropped (with a
        warning) when Redis fails. A key that is not a hash is replaced by the update applied to
        nothing."""
        if update.replace:
            return await self.save(key, dict(update.values))
        if not self.breaker.allow():
            return
        k = self.key(key)
        args: list[str | int] = [self.ttl_s, len(update.sums)]
        for name, (scale, add) in update.sums.items():
            args += [name, repr(float(scale)), repr(float(add))]
        for name, value in update.values.items():
            args += [name, repr(float(value))]
        try:
            await self._redis.eval(_UPDATE, 1, k, *args)
        except redis.exceptions.ResponseError as e:
            if "WRONGTYPE" not in str(e):
                self._failed("update", e)
                return
            self.breaker.success()
            log.warning("shared policy state: %s is not a hash; replacing it", k)
            return await self.save(key, update.apply({}))
        except REDIS_ERRORS as e:
            self._failed("update", e)
            return
        self.breaker.success()

    async def ping(self) -> None:
        """Returns when Redis answers; raises Unavailable otherwise (for health checks)."""
        try:
            await self._redis.ping()
        except REDIS_ERRORS as e:
            raise self._unavailable(e) from e

    async def close(self) -> None:
        await self._redis.aclose()


def build_state_store(redis_url: str | None, namespace: str = "specd") -> AsyncStateStore:
    """Redis when a URL is given, else the process-local memory store."""
    if redis_url:
        return RedisStateStore(redis_url, namespace)
    return AsyncMemoryStateStore()
