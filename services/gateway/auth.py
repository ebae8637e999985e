"""API-key authentication and per-key limits of the gateway's /v1 routes.

KeyedRoute checks the key before FastAPI reads the request body (a FastAPI dependency would
run only after the body is parsed): a request with a missing or unknown key is a 401 with
`WWW-Authenticate: Bearer` whatever its body, and an unauthenticated client cannot make the
gateway read or parse anything. /health and /metrics are not /v1 routes and stay open.

Auth.admit applies the key's limits (services.gateway.limits) to one generation once its
parameters are valid; the Lease it returns ends the generation's admission and gives the
unused tokens back when the response ends, however it ends.

Failure policy (the key store or the limiter unreachable):
- key lookups fail closed: a key is accepted only if the store says so, or (store down) if it
  was accepted within keys.OUTAGE_GRACE_S; any other key gets 503 with Retry-After, not 401;
- limits fail open: a generation is admitted without limits, with a warning in the log and
  specd_gateway_key_store_errors_total{op="limits"}; the limiter is not asked again for
  LIMITS_RETRY_S, so that a Redis that does not answer costs one timeout a second, not one a
  request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable

from fastapi import Request, Response
from fastapi.routing import APIRoute

from services.common.state import redact_url
from services.coordinator.api import Event, FinishEvent, TokenEvent
from services.gateway import limits as rate
from services.gateway.errors import RateLimited, Unauthorized
from services.gateway.keys import KeyRecord, KeyRing
from services.gateway.limits import Limiter, MemoryLimiter
from services.gateway.metrics import GatewayMetrics
from specd.errors import SpecdError, Unavailable

log = logging.getLogger(__name__)

LIMITS_RETRY_S = 1.0  # after the limiter failed, admit without limits this long before asking again
WARN_EVERY_S = 10.0


def bearer(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header, else None."""
    scheme, _, key = (authorization or "").partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


class Lease:
    """One admitted generation: close() ends its admission and its key's lease (once)."""

    def __init__(self, release: Callable[[], None], auth: Auth | None = None, record: KeyRecord | None = None,
                 lease_id: str = "", charged: int = 0) -> None:
        self._release, self._auth, self._record = release, auth, record
        self._lease_id, self._charged = lease_id, charged
        self.used: int | None = None  # completion tokens, once every choice's finish event was seen
        self.prompt = 0  # prompt tokens, from the finish event
        self.streamed = 0  # tokens of the token events seen: what a cut stream cost
        self.choices = 1  # the request's n: generations whose finish events settle it
        self._finished, self._completed = 0, 0
        self._closed = False

    def observe(self, event: Event) -> Event:
        """Pass an event through, noting the tokens it carries (a cut stream is settled by them)."""
        if isinstance(event, FinishEvent):
            self._finished, self._completed = self._finished + 1, self._completed + event.completion_tokens
            self.prompt = event.prompt_tokens
            if self._finished >= self.choices:
                self.used = self._completed
        elif isinstance(event, TokenEvent):
            self.streamed += len(event.token_ids)
        return event

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._release()
        if self._auth is not None and self._record is not None:
            self._auth.finished(self._record, self._lease_id, self._charged, self.used, self.prompt, self.streamed)


class Auth:
    """The gateway's key checks: open (keys None) or required."""

    def __init__(self, keys: KeyRing | None, limiter: Limiter | None, metrics: GatewayMetrics) -> None:
        self.keys = keys
        self.limiter = limiter if limiter is not None else MemoryLimiter()
        self.metrics = metrics
        if keys is not None:
            keys.on_store_error = metrics.key_store_errors.labels("lookup").inc
        self._limits_down_until = 0.0
        self._warned_at = -WARN_EVERY_S
        self._tasks: set[asyncio.Task] = set()  # releases in flight (kept from the garbage collector)

    @property
    def required(self) -> bool:
        return self.keys is not None

    def _warn(self, message: str, *args) -> None:
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning(message, *args)

    async def authenticate(self, request: Request) -> None:
        """Unauthorized unless the request carries a known key (when keys are required); the
        key's record goes to request.state.api_key."""
        if self.keys is None:
            return
        key = bearer(request.headers.get("authorization"))
        if key is None:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        try:
            record = await self.keys.identify(key)
        except Unavailable as e:
            self._warn("refusing requests with keys not seen recently: %s", e)
            raise Unavailable("API keys cannot be checked right now; retry later") from e
        if record is None:
            raise Unauthorized("invalid API key")
        request.state.api_key = record

    async def admit(self, request: Request, max_tokens: int, release: Callable[[], None]) -> Lease:
        """Admit one generation charged max_tokens under the request's key's limits, or raise
        RateLimited (429); `release` ends its admission and is called by the lease's close."""
        record: KeyRecord | None = getattr(request.state, "api_key", None)
        if record is None:
            return Lease(release)
        label = self.metrics.key_label(record.name)
        limits = record.limits
        if limits.unlimited or time.monotonic() < self._limits_down_until:
            self.metrics.key_requests.labels(label, "admitted").inc()
            return Lease(release, self, record)
        lease_id = uuid.uuid4().hex
        try:
            decision = await self.limiter.acquire(record.name, limits, max_tokens, lease_id)
        except Unavailable as e:
            self._limits_down_until = time.monotonic() + LIMITS_RETRY_S
            self.metrics.key_store_errors.labels("limits").inc()
            self._warn("rate limits are not enforced while the limiter is unreachable: %s", e)
            self.metrics.key_requests.labels(label, "admitted").inc()
            return Lease(release, self, record)
        headers = rate.headers(limits, decision)
        if not decision.allowed:
            self.metrics.key_requests.labels(label, "rate_limited").inc()
            raise RateLimited(_refusal(record.name, limits, decision), decision.kind,
                              {"Retry-After": str(rate.retry_after_s(decision)), **headers})
        self.metrics.key_requests.labels(label, "admitted").inc()
        request.state.ratelimit_headers = headers
        return Lease(release, self, record, lease_id, decision.charged)

    async def task_tag(self, record: KeyRecord | None, tag: str) -> str:
        """The task tag to forward for a request of `record` asking for `tag`: scoped to the key
        (limits.scoped_tag), and past the key's max_task_tags (or when the limiter cannot tell)
        the key's own `default`, so a client sending ever new tags cannot grow the shared state.
        Open auth (no key): one tenant, the tag as sent."""
        if record is None:
            return tag
        if tag != "default":
            try:
                allowed = await self.limiter.task_tag(record.name, tag)
            except Unavailable as e:
                self.metrics.key_store_errors.labels("limits").inc()
                self._warn("task tags cannot be counted; using each key's default tag: %s", e)
                allowed = False
            if not allowed:
                self._warn("API key %r is past its distinct task tags; %r uses the key's default tag",
                           record.name, tag)
                tag = "default"
        return rate.scoped_tag(record.name, tag)

    async def scope_task_tag(self, request: Request, gen):
        """`gen` (a GenerateRequest) with the task tag task_tag() gives for the request's key:
        what the gateway forwards to the coordinator, which never sees the key."""
        tag = await self.task_tag(getattr(request.state, "api_key", None), gen.spec.task_tag)
        if tag == gen.spec.task_tag:
            return gen
        return dataclasses.replace(gen, spec=dataclasses.replace(gen.spec, task_tag=tag))

    def finished(self, record: KeyRecord, lease_id: str, charged: int, used: int | None, prompt: int = 0,
                 streamed: int = 0) -> None:
        """A generation of `record` ended: count its tokens, settle its charge (limits.settle)."""
        if used is not None:
            self.metrics.key_tokens.labels(self.metrics.key_label(record.name)).inc(used)
        if not lease_id:
            return
        refund = rate.settle(charged, used, prompt, streamed)
        task = asyncio.get_running_loop().create_task(self._release(record, lease_id, refund))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, record: KeyRecord, lease_id: str, refund: int) -> None:
        try:
            await self.limiter.release(record.name, record.limits, lease_id, refund)
        except Unavailable as e:  # the lease expires by itself (limits.LEASE_TTL_S)
            self.metrics.key_store_errors.labels("limits").inc()
            self._warn("could not release a lease of key %r: %s", record.name, e)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.keys is not None:
            await self.keys.close()
        await self.limiter.close()


def _refusal(name: str, limits, d: rate.Decision) -> str:
    if d.kind == "concurrent":
        return (f"Rate limit reached for API key {name!r} on concurrent requests: limit "
                f"{limits.concurrent_requests}; retry when one of them has ended")
    if d.kind == "tokens":
        return (f"Rate limit reached for API key {name!r} on tokens per min (TPM): limit "
                f"{limits.tokens_per_minute}, remaining {max(0, d.remaining_tokens)}; max_tokens is charged "
                f"up front; retry in {rate.retry_after_s(d)} s or ask for fewer")
    return (f"Rate limit reached for API key {name!r} on requests per min (RPM): limit "
            f"{limits.requests_per_minute}; retry in {rate.retry_after_s(d)} s")


class KeyedRoute(APIRoute):
    """A route whose API key is checked before FastAPI reads the body, and whose response
    carries the key's x-ratelimit-* headers."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def keyed(request: Request) -> Response:
            await request.app.state.gateway.auth.authenticate(request)
            response = await handler(request)
            response.headers.update(getattr(request.state, "ratelimit_headers", {}))
            return response

        return keyed


async def from_settings(s) -> tuple[KeyRing | None, Limiter | None]:
    """The key ring (None: open) and limiter (None when open) of `specd serve gateway`
    (s: GatewaySettings).
    Fails closed: with auth required and no key anywhere, a SpecdError that says how to make
    one; an unreachable key store also stops the start (Unavailable)."""
    from services.gateway.keys import build_key_store
    from services.gateway.limits import build_limiter

    if s.auth == "open":
        log.warning("auth is OPEN: /v1 answers anyone who can reach %s:%s without an API key",
                    s.host, s.port)
        print(f"WARNING: the API is open (--auth open): anyone who can reach {s.host}:{s.port} may use it",
              flush=True)
        return None, None
    static = [k.strip() for k in s.api_keys.split(",") if k.strip()]
    keys = KeyRing(build_key_store(s.redis_url, s.keys_file), static)
    try:
        count = await keys.count()
    except BaseException:
        await keys.close()
        raise
    if count == 0:
        await keys.close()
        if s.keys_file:
            how = f"create one with `specd keys create NAME --keys-file {s.keys_file}`"
        elif s.redis_url:
            how = f"create one with `specd keys create NAME --redis-url {redact_url(s.redis_url)}`"
        else:
            how = ("give the gateway a key store (--keys-file PATH, or --redis-url URL) and create a key "
                   "with `specd keys create NAME --keys-file PATH` (or --redis-url URL)")
        raise SpecdError(f"auth is required and there is no API key: {how}; or start the gateway with "
                         "--auth open to serve without keys")
    source = f"keys file {s.keys_file}" if s.keys_file else "Redis" if s.redis_url else "api_keys"
    log.info("auth required: %d API key(s) (%s)", count, source)
    return keys, build_limiter(s.redis_url, max_task_tags=s.max_task_tags_per_key)
