"""The one thread a model service runs torch on.

A model service computes on one worker thread so that its event loop stays free for gRPC. Every
tensor operation of the process belongs on that thread, loading and start-up measurements
included: once torch has run on a second thread (the main one), the worker's forwards on the
CPU ran markedly slower (docs/engine.md, "One compute thread, from the start"). So a service
builds its servicer on the compute thread and keeps using it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def compute_thread(name: str) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix=name)


async def build_on(executor: ThreadPoolExecutor, build: Callable[..., T], *args) -> T:
    """build(*args, executor) run on the compute thread (the event loop keeps running)."""
    return await asyncio.get_running_loop().run_in_executor(executor, build, *args, executor)
