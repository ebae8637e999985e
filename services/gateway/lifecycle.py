"""The gateway's graceful shutdown: uvicorn's server with a drain in front of its own shutdown.

On the first SIGTERM or SIGINT the gateway drains: /health answers 503 {"status": "draining"},
every new generation is refused with 503 and Retry-After (Admission.draining), and the
generations in flight, streams included, finish, for up to grace_s; then uvicorn shuts down
(closing idle connections, waiting at most SHUTDOWN_TIMEOUT_S more for any still open). A
second signal exits at once.
"""

from __future__ import annotations

import time

import uvicorn

SHUTDOWN_TIMEOUT_S = 5.0  # uvicorn's own graceful shutdown, once the drain is over


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, admission, grace_s: float) -> None:
        super().__init__(config)
        self.admission, self.grace_s = admission, grace_s
        self.drain_started: float | None = None

    def handle_exit(self, sig, frame) -> None:  # called by uvicorn's signal handler
        if self.drain_started is not None:
            self.force_exit = self.should_exit = True
            return
        self.drain_started = time.monotonic()
        self.admission.draining = True

    def drain(self) -> None:
        """Start draining as a signal would (for an orderly stop from code)."""
        self.handle_exit(None, None)

    async def on_tick(self, counter: int) -> bool:  # uvicorn's main loop asks every 0.1 s
        if self.drain_started is not None and not self.should_exit:
            if self.admission.in_flight == 0 or time.monotonic() - self.drain_started >= self.grace_s:
                self.should_exit = True
        return await super().on_tick(counter)
