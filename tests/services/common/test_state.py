"""Shared policy state stores: memory, and Redis as seen by several coordinator replicas."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import redis

from services.common.state import AsyncMemoryStateStore, RedisStateStore, build_state_store
from specd.errors import Unavailable
from specd.state import StateKey

KEY = StateKey("HuggingFaceTB/SmolLM2-135M", "meta-llama/Llama-3.1-8B", "specdec++", "code")
STATE = {"threshold": 0.1 + 0.2, "mean_accept": 1 / 3, "k": 4.0, "tiny": 5e-324,
         "big": 1.7976931348623157e308}


async def _round_trip(store, key=KEY, state=STATE):
    try:
        assert await store.load(key) == {}
        await store.save(key, state)
        return await store.load(key)
    finally:
        await store.close()


def test_memory_round_trip():
    store = build_state_store(None)
    assert isinstance(store, AsyncMemoryStateStore)
    assert asyncio.run(_round_trip(store)) == STATE


def test_build_picks_redis_for_a_url(redis_url):
    store = build_state_store(redis_url)
    assert isinstance(store, RedisStateStore)
    asyncio.run(store.close())
    assert isinstance(build_state_store(""), AsyncMemoryStateStore)


def test_redis_round_trip_is_exact(redis_url):
    state = {**STATE, "inf": float("inf"), "neg": -0.0}
    loaded = asyncio.run(_round_trip(RedisStateStore(redis_url), state=state))
    assert loaded == state
    assert all(type(v) is float for v in loaded.values())
    assert str(loaded["neg"]) == "-0.0"


def test_save_replaces_and_empty_save_deletes(redis_url):
    async def run():
        store = RedisStateStore(redis_url)
        try:
            await store.save(KEY, {"a": 1.0, "b": 2.0})
            await store.save(KEY, {"b": 3.0})
            assert await store.load(KEY) == {"b": 3.0}
            await store.save(KEY, {})
            assert await store.load(KEY) == {}
        finally:
            await store.close()

    asyncio.run(run())
    with redis.Redis.from_url(redis_url) as raw:
        assert raw.keys("*") == []


def test_replicas_see_each_others_writes_and_a_restart_keeps_state(redis_url):
    async def run():
        a, b = RedisStateStore(redis_url), RedisStateStore(redis_url)
        try:
            await a.save(KEY, {"k": 3.0})
            assert await b.load(KEY) == {"k": 3.0}
            await b.save(KEY, {"k": 5.0})
            assert await a.load(KEY) == {"k": 5.0}
        finally:
            await a.close()
            await b.close()
        fresh = RedisStateStore(redis_url)  # a coordinator started again
        try:
            assert await fresh.load(KEY) == {"k": 5.0}
        finally:
            await fresh.close()

    asyncio.run(run())


def test_state_survives_a_redis_restart(redis_server, redis_url):
    async def save():
        store = RedisStateStore(redis_url)
        await store.save(KEY, {"k": 6.0})
        await store.close()

    asyncio.run(save())
    redis_server.restart()
    assert asyncio.run(_load(redis_server.url, KEY)) == {"k": 6.0}


async def _load(url, key, namespace="specd"):
    store = RedisStateStore(url, namespace)
    try:
        return await store.load(key)
    finally:
        await store.close()


def test_key_layout_is_namespaced(redis_url):
    async def run():
        for ns in ("specd", "staging"):
            store = RedisStateStore(redis_url, namespace=ns)
            await store.save(KEY, {"threshold": 0.25})
            await store.close()

    asyncio.run(run())
    with redis.Redis.from_url(redis_url, decode_responses=True) as raw:
        parts = "HuggingFaceTB/SmolLM2-135M|meta-llama/Llama-3.1-8B|specdec++|code"
        assert sorted(raw.keys("*")) == [f"specd:v1:policy-state:{parts}", f"staging:v1:policy-state:{parts}"]
        assert raw.hgetall(f"specd:v1:policy-state:{parts}") == {"threshold": "0.25"}


def test_tags_and_policies_do_not_collide(redis_url):
    keys = [StateKey("d", "t", "ema", "code"), StateKey("d", "t", "ema", "chat"),
            StateKey("d", "t", "heuristic", "code"), StateKey("d2", "t", "ema", "code"),
            # these two would both be "d|t|ema|code|x" without escaping "|"
            StateKey("d", "t", "ema|code", "x"), StateKey("d", "t|ema", "code", "x")]

    async def run():
        store = RedisStateStore(redis_url)
        try:
            for i, key in enumerate(keys):
                await store.save(key, {"i": float(i)})
            return [await store.load(key) for key in keys]
        finally:
            await store.close()

    assert asyncio.run(run()) == [{"i": float(i)} for i in range(len(keys))]


def test_odd_characters_round_trip(redis_url):
    keys = [StateKey("a|b%7Cc", "t:a:r/g\\et", "p o|l", "täsk %25 |\n*"),
            StateKey("a%7Cb%257Cc", "t:a:r/g\\et", "p o|l", "täsk %25 |\n*"),  # a's escaped form, unescaped
            StateKey("", "", "", "")]

    async def run():
        store = RedisStateStore(redis_url)
        try:
            for i, key in enumerate(keys):
                await store.save(key, {"odd field|": float(i)})
            assert len({store.key(k) for k in keys}) == len(keys)
            return [await store.load(key) for key in keys]
        finally:
            await store.close()

    assert asyncio.run(run()) == [{"odd field|": float(i)} for i in range(len(keys))]


def test_unreachable_redis_raises_unavailable_quickly():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"redis://user:s3cret@127.0.0.1:{port}/0"

    async def run():
        store = RedisStateStore(url)
        try:
            for call in (store.ping(), store.load(KEY), store.save(KEY, {"k": 1.0})):
                with pytest.raises(Unavailable) as e:
                    await call
                assert f"127.0.0.1:{port}" in str(e.value) and "s3cret" not in str(e.value)
        finally:
            await store.close()

    start = time.monotonic()
    asyncio.run(run())
    assert time.monotonic() - start < 3
