"""Adaptive policy state is shared by coordinator replicas through Redis: what one
coordinator's requests learned is where the next request on another coordinator starts."""

from __future__ import annotations

import asyncio

from services.common.state import RedisStateStore
from services.coordinator.api import FinishEvent, GenerateRequest
from services.coordinator.coordinator import Coordinator, CoordinatorConfig
from specd.state import StateKey
from specd.types import SamplingParams, SpecParams

REQUEST = GenerateRequest(prompt="Hello there, how are", sampling=SamplingParams(max_new_tokens=24),
                          spec=SpecParams("heuristic", task_tag="chat"), overlap=False)


def run_on_new_coordinator(target, draft, redis_url) -> dict:
    async def run():
        coord = Coordinator(CoordinatorConfig(target, draft), RedisStateStore(redis_url))
        await coord.connect()
        stats = {}
        async for ev in coord.generate(REQUEST):
            if isinstance(ev, FinishEvent):
                stats = ev.spec_stats
        await coord.close()
        return stats

    return asyncio.run(run())


def load(redis_url, key: StateKey) -> dict:
    async def run():
        store = RedisStateStore(redis_url)
        try:
            return await store.load(key)
        finally:
            await store.close()

    return asyncio.run(run())


def test_a_second_coordinator_starts_from_the_first_ones_state(target_service, hf_draft_service, redis_url):
    key = StateKey("tiny-chat-draft", "tiny-chat-target", "heuristic", "chat")
    assert load(redis_url, key) == {}
    first = run_on_new_coordinator(target_service.address, hf_draft_service.address, redis_url)
    saved = load(redis_url, key)
    assert saved and saved["k"] >= 1
    second = run_on_new_coordinator(target_service.address, hf_draft_service.address, redis_url)
    # Sequential windows: the first window of the second request is the K the first one left.
    assert second["draft_lengths"][0] == int(saved["k"])
    assert first["draft_lengths"][0] == 5  # the default K0, since nothing was saved before


# -- Redis can never cost an answer ------------------------------------------------------------

import time  # noqa: E402

import pytest  # noqa: E402
import redis  # noqa: E402

from services.common.state import AsyncMemoryStateStore  # noqa: E402
from services.coordinator.api import TokenEvent  # noqa: E402

KEY = StateKey("tiny-chat-draft", "tiny-chat-target", "heuristic", "chat")


def answer(target, draft, store, request=REQUEST, during=None, after=None) -> tuple[list[int], dict, dict]:
    """(token ids, spec_stats, seconds) of one request on a new coordinator over `store`;
    during() runs after the first token, after(coord) once the answer is complete."""
    async def run():
        coord = Coordinator(CoordinatorConfig(target, draft), store)
        await coord.connect()
        ids, stats, t = [], {}, {}
        try:
            start = time.monotonic()
            async for ev in coord.generate(request):
                if isinstance(ev, TokenEvent):
                    if not ids and during is not None:
                        during()
                    ids += ev.token_ids
                elif isinstance(ev, FinishEvent):
                    stats, t["answer"] = ev.spec_stats, time.monotonic() - start
            if after is not None:
                await after(coord)
        finally:
            await coord.close(save_grace_s=10)
        return ids, stats, t

    return asyncio.run(run())


@pytest.fixture(scope="module")
def alone(target_service, hf_draft_service) -> list[int]:
    """The target alone's answer to REQUEST."""
    plain = GenerateRequest(prompt=REQUEST.prompt, sampling=REQUEST.sampling, spec=SpecParams("none"))
    return answer(target_service.address, hf_draft_service.address, AsyncMemoryStateStore(), plain)[0]


def test_redis_stopped_mid_request_costs_nothing(target_service, hf_draft_service, redis_server, redis_url, alone):
    try:
        ids, stats, _ = answer(target_service.address, hf_draft_service.address, RedisStateStore(redis_url),
                               during=redis_server.stop)
        assert ids == alone and not stats["fallback"]
        # Redis still down: the next request starts from the defaults and is answered the same
        ids, stats, _ = answer(target_service.address, hf_draft_service.address, RedisStateStore(redis_url))
        assert ids == alone and stats["draft_lengths"][0] == 5
    finally:
        redis_server.start(redis_server.port)


def test_after_a_failure_redis_is_skipped(target_service, hf_draft_service, redis_server, redis_url, alone):
    async def restart_then_request(coord):  # Redis is back, but within the breaker's cool-down
        redis_server.start(redis_server.port)
        ids = []
        async for ev in coord.generate(REQUEST):
            ids += ev.token_ids if isinstance(ev, TokenEvent) else []
        assert ids == alone

    redis_server.stop()
    try:
        ids, _, _ = answer(target_service.address, hf_draft_service.address, RedisStateStore(redis_url),
                           after=restart_then_request)
        assert ids == alone
        with redis.Redis.from_url(redis_url) as raw:
            stats = raw.info("commandstats")
        assert not {"cmdstat_hgetall", "cmdstat_hset", "cmdstat_exec"} & set(stats), stats  # not touched
    finally:
        if redis_server.proc is None:
            redis_server.start(redis_server.port)


@pytest.mark.parametrize("trouble", ["read-only", "string field", "list key"])
def test_a_misbehaving_redis_costs_nothing(target_service, hf_draft_service, redis_server, redis_url, alone, trouble):
    store = RedisStateStore(redis_url)
    with redis.Redis.from_url(redis_url) as raw:
        if trouble == "read-only":  # a master turned replica (of nothing): writes fail with READONLY
            raw.execute_command("REPLICAOF", "127.0.0.1", "1")
        elif trouble == "string field":
            raw.hset(store.key(KEY), mapping={"k": "abc"})
        else:
            raw.rpush(store.key(KEY), "x")  # WRONGTYPE for HGETALL
        try:
            ids, stats, _ = answer(target_service.address, hf_draft_service.address, store)
        finally:
            raw.execute_command("REPLICAOF", "NO", "ONE")
    assert ids == alone and not stats["fallback"]
    assert stats["draft_lengths"][0] == 5  # started from the defaults
    if trouble != "read-only":
        assert load(redis_url, KEY)["k"] >= 1  # the save replaced the corrupt value


def test_the_answer_does_not_wait_for_the_save(target_service, hf_draft_service, redis_url, alone):
    """Writes paused for 3 s (CLIENT PAUSE WRITE): the answer arrives at once, the save after."""
    with redis.Redis.from_url(redis_url) as raw:
        raw.execute_command("CLIENT", "PAUSE", "3000", "WRITE")
    ids, _, t = answer(target_service.address, hf_draft_service.address, RedisStateStore(redis_url, timeout_s=10))
    assert ids == alone
    assert t["answer"] < 2.5
    assert load(redis_url, KEY)["k"] >= 1  # close() waited for the save
