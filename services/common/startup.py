"""Waiting for a dependency at start-up: a coordinator whose target is not up yet (or a gateway
whose coordinator is not) retries with exponential backoff, logging one line per retry, instead
of exiting and being restarted in a loop; past its start-up deadline it gives up with
Unavailable (the process then exits non-zero)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from specd.errors import Overloaded, Unavailable

log = logging.getLogger(__name__)

FIRST_DELAY_S = 0.25
MAX_DELAY_S = 5.0


async def retry_until_connected(connect: Callable[[], Awaitable[None]], what: str, deadline_s: float, *,
                                first_delay_s: float = FIRST_DELAY_S, max_delay_s: float = MAX_DELAY_S) -> None:
    """Await connect() until it succeeds. It is retried after Unavailable or Overloaded (the
    dependency is not there yet), with delays doubling from first_delay_s up to max_delay_s;
    any other error (a misconfiguration) is raised at once, and so is the last Unavailable
    once deadline_s have passed since the first try."""
    start = time.monotonic()
    delay, attempt = first_delay_s, 1
    while True:
        try:
            await connect()
        except (Unavailable, Overloaded) as e:
            waited = time.monotonic() - start
            if waited + delay > deadline_s:
                raise Unavailable(f"{what} not reachable within the start-up deadline of {deadline_s:g} s: {e}") from e
            log.warning("start-up: %s not reachable yet (attempt %d, %s); retrying in %.2f s", what, attempt, e, delay)
            await asyncio.sleep(delay)
            delay, attempt = min(delay * 2, max_delay_s), attempt + 1
            continue
        if attempt > 1:
            log.info("start-up: %s reached after %d attempts", what, attempt)
        return
