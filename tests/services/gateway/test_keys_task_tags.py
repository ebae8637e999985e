"""Client-chosen task tags: scoped to the API key, at most max_task_tags distinct ones a key
(past them, the key's default), so random tags leave Redis's key count bounded."""

from __future__ import annotations

import asyncio
import secrets

import pytest
import redis

from services.common.state import RedisStateStore
from services.gateway.auth import Auth
from services.gateway.keys import KeyRing, Limits, RedisKeyStore
from services.gateway.limits import MemoryLimiter, RedisLimiter, scoped_tag
from services.gateway.metrics import GatewayMetrics
from specd.state import StateKey
from specd.types import SpecParams

CAP, TAGS = 50, 2000


def _random_tag() -> str:
    return secrets.token_urlsafe(secrets.choice([4, 16, 47]))[:64]


async def _tenants(url: str, limiter):
    store = RedisKeyStore(url)
    ring = KeyRing(store)
    records = []
    for name in ("alice", "b" * 64):  # the longest name: scoped tags fall back to a digest
        records.append(await ring.identify(await store.create(name, Limits())))
    return Auth(ring, limiter, GatewayMetrics()), records


@pytest.mark.parametrize("limiter", ["redis", "memory"])
def test_random_task_tags_leave_redis_bounded(redis_url, limiter):
    async def scenario():
        made = RedisLimiter(redis_url, max_task_tags=CAP) if limiter == "redis" else MemoryLimiter(CAP)
        auth, (alice, bob) = await _tenants(redis_url, made)
        state = RedisStateStore(redis_url)
        forwarded = set()
        for i in range(TAGS):  # what the coordinator gets, saved where the coordinator saves it
            record = (alice, bob)[i % 2]
            tag = await auth.task_tag(record, _random_tag())
            SpecParams(task_tag=tag).validate()  # a tag the coordinator accepts
            forwarded.add(tag)
            await state.save(StateKey("draft", "target", "policy", tag), {"k": 3.0, "threshold": 0.5})
        # Past the cap a key's new tags are its own default.
        assert await auth.task_tag(alice, "one-more") == await auth.task_tag(alice, "default")
        await state.close()
        await auth.close()
        return forwarded

    forwarded = asyncio.run(scenario())
    assert len(forwarded) == 2 * (CAP + 1)  # each key: CAP tags and its default
    with redis.Redis.from_url(redis_url) as c:
        states = list(c.scan_iter("specd:v1:policy-state:*"))
        assert len(states) == 2 * (CAP + 1)
        assert c.dbsize() <= len(states) + 4  # + the two key hashes, the two tag sets


def test_tags_are_scoped_to_their_key(redis_url):
    async def scenario():
        auth, (alice, bob) = await _tenants(redis_url, MemoryLimiter(CAP))
        tags = {(r.name, t): await auth.task_tag(r, t)
                for r in (alice, bob) for t in ("default", "code", scoped_tag("alice", "default"), "k:" + "0" * 40)}
        assert await auth.task_tag(None, "code") == "code"  # open auth: one tenant, the tag as sent
        await auth.close()
        return tags

    tags = asyncio.run(scenario())
    assert len(set(tags.values())) == len(tags)  # no two (key, tag) share a state
    alice_default = tags[("alice", "default")]
    assert alice_default.endswith("@default") and "alice" not in alice_default  # no key name shown
    assert tags[("b" * 64, alice_default)] != alice_default
    assert scoped_tag("alice", "x") != scoped_tag("alic", "e@x")


def test_task_tags_without_redis_fall_back_to_the_keys_default(redis_server, redis_url):
    """The limiter unreachable: every tag is the key's default (never unbounded growth)."""
    async def scenario():
        auth, (alice, _) = await _tenants(redis_url, RedisLimiter(redis_url, max_task_tags=CAP))
        port = redis_server.port
        with redis.Redis.from_url(redis_url) as c:
            c.save()
        redis_server.stop()
        try:
            return await auth.task_tag(alice, "fresh")
        finally:
            redis_server.start(port)
            await auth.close()

    assert asyncio.run(scenario()) == scoped_tag("alice", "default")
