"""A model service builds its servicer on the compute thread it then serves on, so that torch
never runs a parallel region on a second thread of the process (services.common.compute)."""

from __future__ import annotations

import asyncio
import threading

from services.common.compute import build_on, compute_thread


def test_the_build_runs_on_the_compute_thread_and_gets_it():
    executor = compute_thread("target")

    def build(name, ex):
        return name, ex, threading.current_thread().name

    try:
        name, ex, thread = asyncio.run(build_on(executor, build, "x"))
        assert (name, ex) == ("x", executor)
        assert thread.startswith("target") and thread != threading.main_thread().name
        assert executor.submit(lambda: threading.current_thread().name).result() == thread  # one thread
    finally:
        executor.shutdown()
