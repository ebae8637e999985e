"""Key lookups against a Redis that is stopped or hung (SIGSTOP): the negative cache, the
circuit breaker, and the fast 503 of the gateway."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import redis

from services.gateway import create_app
from services.gateway.keys import KeyRing, Limits, RedisKeyStore

CHAT = "/v1/chat/completions"
HI = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


def _hgets(url: str) -> int:
    with redis.Redis.from_url(url) as c:
        return int(c.info("commandstats").get("cmdstat_hget", {}).get("calls", 0))


def test_an_unknown_key_repeated_costs_one_lookup(redis_url):
    ring = KeyRing(RedisKeyStore(redis_url))

    async def scenario():
        before = _hgets(redis_url)
        for _ in range(50):
            assert await ring.identify("sk-specd-wrong") is None
        calls = _hgets(redis_url) - before
        key = await ring.store.create("real", Limits())  # an unknown digest never hides a new key
        assert (await ring.identify(key)).name == "real"
        await ring.close()
        return calls

    assert asyncio.run(scenario()) == 1


def test_a_hung_redis_costs_one_timeout_per_cool_down(redis_server, redis_url):
    """SIGSTOP: the first lookup waits for its timeout and opens the breaker; then a recently
    validated key is served from the cache at once and any other key is refused at once."""
    store = RedisKeyStore(redis_url, timeout_s=2.0)
    ring = KeyRing(store, cooldown_s=60)

    async def scenario():
        key = await store.create("known", Limits())
        assert (await ring.identify(key)).name == "known"
        await asyncio.sleep(0.6)  # past LOOKUP_TTL_S: the next lookup asks Redis
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert (await ring.identify(key)).name == "known"  # waits for the timeout, then the cache
            first = time.monotonic() - t0
            t0 = time.monotonic()
            for _ in range(20):
                assert (await ring.identify(key)).name == "known"
                try:
                    await ring.identify("sk-specd-other")
                except Exception as e:  # noqa: BLE001 - checked below
                    assert type(e).__name__ == "Unavailable"
                else:
                    raise AssertionError("an unverifiable key was accepted")
            rest = time.monotonic() - t0
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        await ring.close()
        return first, rest

    first, rest = asyncio.run(scenario())
    assert first >= 2.0  # the one lookup that found the hang
    assert rest < 1.0  # 40 lookups after it: none waited for Redis (each would cost 2 s)


def test_a_stopped_redis_fresh_keys_pass_others_get_a_fast_503(redis_server, redis_url, serve, local_backend):
    """Over HTTP: with Redis down, a key validated before works, an unknown one is 503 with
    Retry-After (not 401); once Redis is back (the breaker's probe) every key works again."""
    store = RedisKeyStore(redis_url)
    ring = KeyRing(store, cooldown_s=0.2)
    known = asyncio.run(RedisKeyStore(redis_url).create("known", Limits()))
    later = asyncio.run(RedisKeyStore(redis_url).create("later", Limits()))
    url = serve(create_app(local_backend, keys=ring))

    def models(key: str) -> httpx.Response:
        return httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)

    assert models(known).status_code == 200
    with redis.Redis.from_url(redis_url) as c:
        c.save()  # the fixture's server has no persistence of its own: keep the keys for the restart
    port = redis_server.port
    redis_server.stop()
    try:
        time.sleep(0.6)  # past LOOKUP_TTL_S
        assert models(known).status_code == 200
        r = httpx.post(url + CHAT, json=HI, headers={"Authorization": f"Bearer {known}"}, timeout=30)
        assert r.status_code == 200, r.text
        for _ in range(5):
            r = models(later)  # valid, but never seen by this gateway: it cannot tell
            assert r.status_code == 503 and r.headers["retry-after"], r.text
    finally:
        redis_server.start(port)
    deadline = time.monotonic() + 10
    while models(later).status_code != 200:
        assert time.monotonic() < deadline, "the key ring did not recover after Redis came back"
        time.sleep(0.05)
    assert models("sk-specd-wrong").status_code == 401
