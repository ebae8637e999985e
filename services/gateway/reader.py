"""Whether the client of a streamed response still reads it.

A client that stops reading is not seen by a send that waits: the kernel's send buffer and the
client's receive buffer take a long answer's chunks (hundreds of KB on loopback) without a
wait, and the generation, its KV slot and the key's lease stay held until the answer ends.
So the stream looks at what the client has taken instead: the bytes the transport still holds
plus those in the kernel's send queue (TIOCOUTQ: not yet acknowledged by the peer). A client
that reads lets them fall to zero, or below what they were after the last write; one whose
receive window stays full lets them only grow. A stream whose bytes wait with none taken for
idle_s has a stalled reader.

The transport reaches the app through the ASGI scope (TRANSPORT, set by the gateway's uvicorn
protocol, services.gateway.main). Where it is absent, or the platform has no TIOCOUTQ, nothing
is watched and only the send timeout applies.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable

try:
    import fcntl
    import termios
except ImportError:  # not a POSIX system: nothing is watched
    fcntl = termios = None

TRANSPORT = "specd.transport"  # the scope["extensions"] key of the connection's asyncio transport
_OUTQ = getattr(termios, "TIOCOUTQ", None)


def waiting_bytes(transport) -> int | None:
    """Bytes written to `transport` that its peer has not acknowledged: the transport's own
    buffer and the kernel's send queue; None where they cannot be read."""
    sock = transport.get_extra_info("socket")
    if _OUTQ is None or sock is None or transport.is_closing():
        return None
    try:
        queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0"))[0]
    except OSError:
        return None
    return transport.get_write_buffer_size() + queued


class ReaderWatch:
    """Tells, before each write of a stream, whether its client has taken no byte for idle_s
    while bytes waited for it."""

    def __init__(self, transport, idle_s: float, clock: Callable[[], float] = time.monotonic):
        self.transport, self.idle_s, self.clock = transport, idle_s, clock
        self.after_write = 0  # bytes waiting right after the last write
        self.progress_at = clock()  # when the client was last seen taking bytes (or had none to take)

    @classmethod
    def of(cls, scope, idle_s: float | None) -> ReaderWatch | None:
        """A watch over scope's connection; None where it has no transport or cannot be read."""
        transport = scope.get("extensions", {}).get(TRANSPORT)
        if idle_s is None or transport is None or waiting_bytes(transport) is None:
            return None
        return cls(transport, idle_s)

    def stalled(self) -> bool:
        waiting = waiting_bytes(self.transport)
        now = self.clock()
        if waiting is None or waiting == 0 or waiting < self.after_write:
            self.progress_at = now
        return now - self.progress_at > self.idle_s

    def wrote(self) -> None:
        self.after_write = waiting_bytes(self.transport) or 0
