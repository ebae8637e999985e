"""The in-process policy-state store is an LRU: random task tags cannot grow it without bound."""

from __future__ import annotations

import asyncio
import secrets

from services.common.state import AsyncMemoryStateStore
from specd.state import MemoryStateStore, StateKey


def test_random_task_tags_leave_the_process_store_bounded():
    memory = MemoryStateStore(max_keys=50)
    store = AsyncMemoryStateStore(memory)
    hot = StateKey("d", "t", "p", "default")

    async def scenario():
        await store.save(hot, {"k": 4.0})
        for i in range(2000):
            await store.save(StateKey("d", "t", "p", secrets.token_hex(8)), {"k": float(i)})
            if i % 10 == 0:
                assert await store.load(hot) == {"k": 4.0}  # used often: never the one dropped

    asyncio.run(scenario())
    assert len(memory) == 50
    assert memory.load(hot) == {"k": 4.0}


def test_an_empty_save_deletes():
    memory = MemoryStateStore()
    key = StateKey("d", "t", "p")
    memory.save(key, {"k": 1.0})
    memory.save(key, {})
    assert len(memory) == 0 and memory.load(key) == {}
