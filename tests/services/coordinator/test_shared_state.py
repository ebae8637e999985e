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
