"""Shared policy state stores: memory, and Redis as seen by several coordinator replicas."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import redis

from services.common.state import STATE_TTL_S, AsyncMemoryStateStore, RedisStateStore, build_state_store
from specd.errors import Unavailable
from specd.state import MemoryStateStore, StateKey, StateUpdate

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_redis_loads_nothing_quickly_and_never_raises(caplog):
    port = _free_port()
    url = f"redis://user:s3cret@127.0.0.1:{port}/0"

    async def run():
        store = RedisStateStore(url)
        try:
            with pytest.raises(Unavailable) as e:  # health checks still learn that Redis is down
                await store.ping()
            assert f"127.0.0.1:{port}" in str(e.value) and "s3cret" not in str(e.value)
            assert await store.load(KEY) == {}
            assert store.breaker.is_open
            await store.save(KEY, {"k": 1.0})  # skipped during the cool-down: no error
        finally:
            await store.close()

    start = time.monotonic()
    asyncio.run(run())
    assert time.monotonic() - start < 3
    assert f"127.0.0.1:{port}" in caplog.text and "s3cret" not in caplog.text


def _commands(url: str) -> dict[str, int]:
    """Calls per command since the server started (INFO commandstats)."""
    with redis.Redis.from_url(url) as raw:
        return {name.removeprefix("cmdstat_"): v["calls"] for name, v in raw.info("commandstats").items()}


def test_breaker_skips_a_failed_redis_then_tries_again(redis_server, redis_url):
    async def save():
        store = RedisStateStore(redis_url)
        await store.save(KEY, {"k": 2.0})
        await store.close()

    asyncio.run(save())
    with redis.Redis.from_url(redis_url) as raw:
        raw.save()
    redis_server.stop()

    async def run():
        store = RedisStateStore(redis_url, cooldown_s=1.0)
        try:
            assert await store.load(KEY) == {}  # Redis down: no state, no error
            redis_server.start(redis_server.port)  # back (same data), but within the cool-down
            assert await store.load(KEY) == {}
            await store.save(KEY, {"k": 3.0})
            assert "hgetall" not in _commands(redis_url) and "hset" not in _commands(redis_url)
            await asyncio.sleep(1.1)
            assert await store.load(KEY) == {"k": 2.0}  # one probe after the cool-down: closed again
            await store.save(KEY, {"k": 3.0})
            assert await store.load(KEY) == {"k": 3.0}
        finally:
            await store.close()

    try:
        asyncio.run(run())
    finally:
        if redis_server.proc is None:
            redis_server.start(redis_server.port)


@pytest.mark.parametrize("refusal", ["read-only replica", "out of memory"])
def test_redis_refusing_writes_drops_the_save(redis_server, redis_url, refusal):
    """READONLY (a master turned replica by a failover) and OOM (maxmemory) refuse writes."""
    with redis.Redis.from_url(redis_url) as raw:
        raw.hset(RedisStateStore(redis_url).key(KEY), mapping={"k": "4.0"})
        if refusal == "read-only replica":
            raw.execute_command("REPLICAOF", "127.0.0.1", str(_free_port()))
        else:
            raw.config_set("maxmemory", "1")
        try:
            async def run():
                store = RedisStateStore(redis_url, cooldown_s=0)
                try:
                    await store.save(KEY, {"k": 5.0})  # refused: dropped with a warning
                    assert store.breaker.is_open
                    return await store.load(KEY)
                finally:
                    await store.close()

            assert asyncio.run(run()) == {"k": 4.0}  # reads still work; the refused write changed nothing
        finally:
            raw.execute_command("REPLICAOF", "NO", "ONE")
            raw.config_set("maxmemory", "0")


def test_corrupt_values_load_as_no_state_and_a_save_repairs_them(redis_url, caplog):
    async def run(prepare):
        store = RedisStateStore(redis_url)
        key = store.key(KEY)
        try:
            with redis.Redis.from_url(redis_url) as raw:
                raw.delete(key)
                prepare(raw, key)
            assert await store.load(KEY) == {}
            assert not store.breaker.is_open  # Redis answered: only this key is bad
            await store.save(KEY, {"k": 6.0})
            return await store.load(KEY)
        finally:
            await store.close()

    assert asyncio.run(run(lambda raw, key: raw.hset(key, mapping={"k": "abc", "t": "0.5"}))) == {"k": 6.0}
    assert "not a float" in caplog.text
    assert asyncio.run(run(lambda raw, key: raw.rpush(key, "a", "b"))) == {"k": 6.0}  # WRONGTYPE
    assert "not a hash" in caplog.text


def test_saved_keys_expire_and_a_save_refreshes_the_ttl(redis_url):
    async def run(ttl_s):
        store = RedisStateStore(redis_url, ttl_s=ttl_s)
        try:
            await store.save(KEY, {"k": 1.0})
            return store.key(KEY)
        finally:
            await store.close()

    key = asyncio.run(run(100))
    with redis.Redis.from_url(redis_url) as raw:
        assert 90 < raw.ttl(key) <= 100
        raw.expire(key, 5)
    asyncio.run(run(STATE_TTL_S))
    with redis.Redis.from_url(redis_url) as raw:
        assert STATE_TTL_S - 10 < raw.ttl(key) <= STATE_TTL_S == 30 * 24 * 3600


def test_replicas_updating_at_once_fold_like_the_memory_store(redis_url):
    """Two replicas end requests that loaded the same state: Redis keeps both requests'
    learning exactly as the process store does (specd.state.StateUpdate), and a value field is
    the last writer's."""
    start = {"n2i1:a": 3.0, "n2i1:r": 1.0, "k": 4.0}
    ends = [({"n2i1:a": 3.5, "n2i1:r": 0.9, "n3i1:a": 1.0, "k": 5.0}, {"n2i1:a": 0.9, "n2i1:r": 0.9, "n3i1:a": 1.0}),
            ({"n2i1:a": 2.7, "n2i1:r": 2.8, "k": 6.0}, {"n2i1:a": 0.8, "n2i1:r": 0.8})]
    updates = [StateUpdate.between(start, end, scale) for end, scale in ends]
    memory = MemoryStateStore()
    memory.save(KEY, start)
    for u in updates:
        memory.update(KEY, u)

    async def run():
        a, b = RedisStateStore(redis_url), RedisStateStore(redis_url)
        try:
            await a.save(KEY, start)
            await asyncio.gather(a.update(KEY, updates[0]), b.update(KEY, updates[1]))
            return await a.load(KEY)
        finally:
            await a.close()
            await b.close()

    saved = asyncio.run(run())
    assert saved == pytest.approx(memory.load(KEY), rel=1e-15)
    assert saved["n2i1:a"] == pytest.approx((3.0 * 0.9 + (3.5 - 2.7)) * 0.8 + (2.7 - 2.4))  # A, then B
    assert saved["k"] == 6.0
    with redis.Redis.from_url(redis_url, decode_responses=True) as raw:
        key = RedisStateStore(redis_url).key(KEY)
        assert 0 < raw.ttl(key) <= STATE_TTL_S


def test_an_update_replaces_a_key_that_is_not_a_hash(redis_url):
    store = RedisStateStore(redis_url)
    with redis.Redis.from_url(redis_url) as raw:
        raw.set(store.key(KEY), "garbage")

    async def run():
        try:
            await store.update(KEY, StateUpdate.between({}, {"n2i1:a": 2.0}, {"n2i1:a": 0.5}))
            return await store.load(KEY)
        finally:
            await store.close()

    assert asyncio.run(run()) == {"n2i1:a": 2.0}
