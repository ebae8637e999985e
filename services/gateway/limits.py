"""Per-key rate limits: requests per minute, tokens per minute, concurrent requests.

Requests and tokens are token buckets that refill continuously: capacity = the per-minute
limit, refilled at limit/60 per second, so a key may burst its whole minute at once and then
goes at the limit's pace. Tokens per minute count prompt and completion tokens. A generation
takes one request and is charged its max_tokens at admission (at most the bucket's capacity,
so that a request larger than a minute's tokens waits for a full bucket rather than forever;
the prompt's length is not known before the coordinator tokenizes it); when it ends, settle()
turns what it really cost (prompt + completion tokens, or for a stream cut before its finish,
the tokens it streamed) into a refund of the unused part or a debit of the excess, which may
take the bucket below zero. Concurrent requests are leases that the response's end releases,
however it ends.

RedisLimiter shares the limits between every gateway replica on one Redis: each decision is
ONE Lua script (atomic, timed by the Redis server's clock, so replicas' clocks do not matter):

    {namespace}:v1:ratelimit:{NAME}:bucket  hash  req, req_at, tok, tok_at (levels, ms);
                                                  expires once both buckets would be full
    {namespace}:v1:ratelimit:{NAME}:leases  zset  lease id -> expiry (ms)

A lease expires LEASE_TTL_S after it was taken or last renewed; the gateway renews its live
leases every LEASE_TTL_S / 3, so a crashed gateway's leases free its keys' slots within
LEASE_TTL_S. (The braces make both keys one Redis Cluster slot.) An unreachable Redis raises
Unavailable; the caller decides (services.gateway.auth: fail open).

Task tags (speculative.task_tag) key the shared policy state, and come from clients: each key
may use at most max_task_tags distinct tags (besides `default`) within TAGS_TTL_S (the policy
state's own TTL), counted in

    {namespace}:v1:ratelimit:{NAME}:tags    zset  tag -> last use (ms); expires TAGS_TTL_S after it

and scoped_tag() puts the key's name in front of every tag the gateway forwards, so that one
key's tags (its `default` too) never share state with another key's.

MemoryLimiter has the same semantics in one process (a single replica without Redis).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Protocol

from services.common.state import REDIS_ERRORS, STATE_TTL_S, redact_url, redis_client
from services.gateway.keys import Limits
from specd.errors import Unavailable

log = logging.getLogger(__name__)

LEASE_TTL_S = 30.0
WINDOW_MS = 60_000  # the limits are per minute
MAX_TASK_TAGS = 50  # distinct task tags of one key (the setting max_task_tags_per_key)
TAGS_TTL_S = STATE_TTL_S  # a tag unused this long no longer counts (its state has expired too)
MAX_TAG_CHARS = 64  # specd.types.TASK_TAG


@dataclass(frozen=True)
class Decision:
    """One admission: allowed or refused (kind: requests, tokens or concurrent), and the state
    of the key's buckets after it."""

    allowed: bool
    kind: str = ""
    retry_after_ms: int = 0
    remaining_requests: int = 0
    remaining_tokens: int = 0
    reset_requests_ms: int = 0  # until the bucket is full again
    reset_tokens_ms: int = 0
    charged: int = 0  # tokens taken from the bucket


class Limiter(Protocol):
    async def acquire(self, name: str, limits: Limits, tokens: int, lease: str) -> Decision:
        """Admit one generation of key `name` charged `tokens`; Unavailable if it cannot tell."""

    async def release(self, name: str, limits: Limits, lease: str, refund: int) -> None:
        """The generation ended: free its lease and give `refund` tokens back (negative: debit)."""

    async def task_tag(self, name: str, tag: str) -> bool:
        """Whether key `name` may use task tag `tag` (one of its max_task_tags); Unavailable if
        it cannot tell."""

    async def close(self) -> None:
        """Release connections and background tasks."""


def scoped_tag(name: str, tag: str) -> str:
    """The task tag forwarded for key `name`'s `tag`: `ID@tag` (ID: 12 hex digits of the name's
    digest, so the coordinator's metrics and Redis show no key name), or, when that is longer
    than a tag may be, `k:` and a digest of both. ID holds no `@` or `:`, so no key can choose a
    tag that lands in another key's state."""
    scoped = f"{hashlib.sha256(name.encode()).hexdigest()[:12]}@{tag}"
    if len(scoped) <= MAX_TAG_CHARS:
        return scoped
    return "k:" + hashlib.sha256(f"{name}@{tag}".encode()).hexdigest()[:40]


def settle(charged: int, completion: int | None, prompt: int = 0, streamed: int = 0) -> int:
    """The tokens to give back when a generation charged `charged` at admission ends
    (negative: to debit). completion and prompt come from its finish event; completion None
    means it ended without one (a cut stream): it cost the `streamed` tokens sent so far, or,
    when none was seen (a disconnected non-streamed request), exactly its admission charge."""
    if completion is not None:
        return charged - (completion + prompt)
    return charged - streamed if streamed else 0


def retry_after_s(decision: Decision) -> int:
    """Whole seconds until the refused request would pass, rounded up, at least 1."""
    return max(1, math.ceil(decision.retry_after_ms / 1000))


def duration(ms: int) -> str:
    """A duration as OpenAI writes its reset headers: 20ms, 1.5s, 1m0s."""
    ms = max(0, int(ms))
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest = divmod(ms, 60_000)
    seconds = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


def headers(limits: Limits, decision: Decision) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers for the limits the key has."""
    out = {}
    for kind, limit, remaining, reset in (
            ("requests", limits.requests_per_minute, decision.remaining_requests, decision.reset_requests_ms),
            ("tokens", limits.tokens_per_minute, decision.remaining_tokens, decision.reset_tokens_ms)):
        if limit:
            out[f"x-ratelimit-limit-{kind}"] = str(limit)
            out[f"x-ratelimit-remaining-{kind}"] = str(max(0, remaining))
            out[f"x-ratelimit-reset-{kind}"] = duration(reset)
    return out


# -- Redis ------------------------------------------------------------------------------------

_SCRIPT = """
-- KEYS[1]: bucket hash; KEYS[2]: leases zset
-- ARGV: op (acquire|release|renew), rpm, tpm, concurrent, tokens, lease, lease_ttl_ms
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local op, lease = ARGV[1], ARGV[6]
local rpm, tpm, conc = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local tokens, ttl = tonumber(ARGV[5]), tonumber(ARGV[7])
if op == 'renew' then
  local renewed = redis.call('ZADD', KEYS[2], 'XX', 'CH', now + ttl, lease)
  if renewed == 1 then redis.call('PEXPIRE', KEYS[2], ttl) end
  return renewed
end
local function level(f, cap)
  if cap <= 0 then return 0 end
  local v = redis.call('HMGET', KEYS[1], f, f .. '_at')
  if not v[1] then return cap end
  return math.min(cap, tonumber(v[1]) + (now - tonumber(v[2])) * cap / 60000)
end
local function until_full(v, cap)
  if cap <= 0 or v >= cap then return 0 end
  return math.ceil((cap - v) * 60000 / cap)
end
local req, tok = level('req', rpm), level('tok', tpm)
local function save()
  redis.call('HSET', KEYS[1], 'req', string.format('%.6f', req), 'req_at', now,
             'tok', string.format('%.6f', tok), 'tok_at', now)
  redis.call('PEXPIRE', KEYS[1], math.max(until_full(req, rpm), until_full(tok, tpm)) + 1000)
end
if op == 'release' then
  redis.call('ZREM', KEYS[2], lease)
  if tpm > 0 and tokens ~= 0 then
    tok = math.min(tpm, tok + tokens)
    save()
  end
  return 1
end
local cost = math.min(tokens, tpm)
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= conc then
    return {0, 'concurrent', 1000, math.floor(req), math.floor(tok), until_full(req, rpm),
            until_full(tok, tpm), 0}
  end
end
if rpm > 0 and req < 1 then
  return {0, 'requests', math.ceil((1 - req) * 60000 / rpm), math.floor(req), math.floor(tok),
          until_full(req, rpm), until_full(tok, tpm), 0}
end
if tpm > 0 and tok < cost then
  return {0, 'tokens', math.ceil((cost - tok) * 60000 / tpm), math.floor(req), math.floor(tok),
          until_full(req, rpm), until_full(tok, tpm), 0}
end
if rpm > 0 then req = req - 1 end
if tpm > 0 then tok = tok - cost end
if rpm > 0 or tpm > 0 then save() end
if conc > 0 then
  redis.call('ZADD', KEYS[2], now + ttl, lease)
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return {1, '', 0, math.floor(req), math.floor(tok), until_full(req, rpm), until_full(tok, tpm), cost}
"""


_TAGS = """
-- KEYS[1]: tags zset; ARGV: tag, max tags, ttl_ms
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('PEXPIRE', KEYS[1], ttl)
return 1
"""


class RedisLimiter:
    def __init__(self, url: str, namespace: str = "specd", *, timeout_s: float = 0.5,
                 lease_ttl_s: float = LEASE_TTL_S, max_task_tags: int = MAX_TASK_TAGS) -> None:
        self.namespace, self.lease_ttl_s, self.max_task_tags = namespace, lease_ttl_s, max_task_tags
        self._safe_url = redact_url(url)
        self._redis = redis_client(url, timeout_s)
        self._script = self._redis.register_script(_SCRIPT)
        self._tags = self._redis.register_script(_TAGS)
        self._live: dict[str, tuple[str, Limits]] = {}  # lease -> (key name, limits): renewed
        self._renewer: asyncio.Task | None = None

    def keys(self, name: str) -> list[str]:
        base = f"{self.namespace}:v1:ratelimit:{{{name}}}"
        return [f"{base}:bucket", f"{base}:leases"]

    def tags_key(self, name: str) -> str:
        return f"{self.namespace}:v1:ratelimit:{{{name}}}:tags"

    async def task_tag(self, name: str, tag: str) -> bool:
        if self.max_task_tags <= 0:
            return False
        try:
            return bool(await self._tags(keys=[self.tags_key(name)],
                                         args=[tag, self.max_task_tags, int(TAGS_TTL_S * 1000)]))
        except REDIS_ERRORS as e:
            raise Unavailable(f"task tags: Redis at {self._safe_url} is unreachable: "
                              f"{type(e).__name__}: {e}") from e

    async def _run(self, op: str, name: str, limits: Limits, tokens: int, lease: str):
        try:
            return await self._script(keys=self.keys(name), args=[
                op, limits.requests_per_minute, limits.tokens_per_minute, limits.concurrent_requests, tokens,
                lease, int(self.lease_ttl_s * 1000)])
        except REDIS_ERRORS as e:
            raise Unavailable(f"rate limits: Redis at {self._safe_url} is unreachable: "
                              f"{type(e).__name__}: {e}") from e

    async def acquire(self, name: str, limits: Limits, tokens: int, lease: str) -> Decision:
        allowed, kind, retry, req, tok, reset_req, reset_tok, charged = await self._run(
            "acquire", name, limits, tokens, lease)
        if allowed and limits.concurrent_requests:
            self._live[lease] = (name, limits)
            if self._renewer is None or self._renewer.done():
                self._renewer = asyncio.ensure_future(self._renew())
        return Decision(bool(allowed), kind, int(retry), int(req), int(tok), int(reset_req), int(reset_tok),
                        int(charged))

    async def release(self, name: str, limits: Limits, lease: str, refund: int) -> None:
        self._live.pop(lease, None)
        await self._run("release", name, limits, refund, lease)

    async def _renew(self) -> None:
        while self._live:
            await asyncio.sleep(self.lease_ttl_s / 3)
            for lease, (name, limits) in list(self._live.items()):
                try:
                    await self._run("renew", name, limits, 0, lease)
                except Unavailable as e:
                    log.warning("could not renew a concurrency lease of key %r: %s", name, e)

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        await self._redis.aclose()


# -- one process ------------------------------------------------------------------------------

@dataclass
class _Buckets:
    req: float | None = None  # None: full
    req_at: float = 0.0
    tok: float | None = None
    tok_at: float = 0.0
    leases: set[str] = field(default_factory=set)


def _level(value: float | None, at: float, cap: int, now: float) -> float:
    if cap <= 0:
        return 0.0
    if value is None:
        return float(cap)
    return min(cap, value + (now - at) * cap / WINDOW_MS)


def _until_full(value: float, cap: int) -> int:
    return 0 if cap <= 0 or value >= cap else math.ceil((cap - value) * WINDOW_MS / cap)


class MemoryLimiter:
    """The same limits in this process only (no Redis: one gateway replica)."""

    def __init__(self, max_task_tags: int = MAX_TASK_TAGS) -> None:
        self.max_task_tags = max_task_tags
        self._keys: dict[str, _Buckets] = {}
        self._tags: dict[str, dict[str, float]] = {}  # key name -> tag -> last use (monotonic s)

    async def task_tag(self, name: str, tag: str) -> bool:
        if self.max_task_tags <= 0:
            return False
        now = time.monotonic()
        tags = self._tags.setdefault(name, {})
        if tag not in tags and len(tags) >= self.max_task_tags:
            for old in [t for t, at in tags.items() if now - at >= TAGS_TTL_S]:
                del tags[old]
            if len(tags) >= self.max_task_tags:
                return False
        tags[tag] = now
        return True

    async def acquire(self, name: str, limits: Limits, tokens: int, lease: str) -> Decision:
        b = self._keys.setdefault(name, _Buckets())
        now = time.monotonic() * 1000
        rpm, tpm, conc = limits.requests_per_minute, limits.tokens_per_minute, limits.concurrent_requests
        req, tok = _level(b.req, b.req_at, rpm, now), _level(b.tok, b.tok_at, tpm, now)
        cost = min(tokens, tpm)

        def decision(allowed: bool, kind: str = "", retry: float = 0) -> Decision:
            return Decision(allowed, kind, math.ceil(retry), math.floor(req), math.floor(tok),
                            _until_full(req, rpm), _until_full(tok, tpm), cost if allowed else 0)

        if conc and len(b.leases) >= conc:
            return decision(False, "concurrent", 1000)
        if rpm and req < 1:
            return decision(False, "requests", (1 - req) * WINDOW_MS / rpm)
        if tpm and tok < cost:
            return decision(False, "tokens", (cost - tok) * WINDOW_MS / tpm)
        if rpm:
            req -= 1
            b.req, b.req_at = req, now
        if tpm:
            tok -= cost
            b.tok, b.tok_at = tok, now
        if conc:
            b.leases.add(lease)
        return decision(True)

    async def release(self, name: str, limits: Limits, lease: str, refund: int) -> None:
        b = self._keys.get(name)
        if b is None:
            return
        b.leases.discard(lease)
        tpm = limits.tokens_per_minute
        if tpm and refund:
            now = time.monotonic() * 1000
            b.tok, b.tok_at = min(tpm, _level(b.tok, b.tok_at, tpm, now) + refund), now

    async def close(self) -> None:
        pass


def build_limiter(redis_url: str | None, namespace: str = "specd", *,
                  max_task_tags: int = MAX_TASK_TAGS) -> Limiter:
    """Redis (shared by the replicas) when a URL is given, else this process's memory."""
    if redis_url:
        return RedisLimiter(redis_url, namespace, max_task_tags=max_task_tags)
    return MemoryLimiter(max_task_tags)
