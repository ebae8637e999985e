"""A real drafter with a fault before each draft step: a draft that dies or stalls in process."""

from __future__ import annotations

from collections.abc import Callable


class Faulty:
    """drafter, with fault(step) called before each of its sessions' draft steps (1, 2, ...):
    it may raise (a draft that dies) or sleep (one that stalls)."""

    def __init__(self, drafter, fault: Callable[[int], None]):
        self.drafter, self.fault = drafter, fault

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def open(self, vocab_size: int):
        return _Session(self.drafter.open(vocab_size), self.fault)


class _Session:
    def __init__(self, session, fault: Callable[[int], None]):
        self._session, self._fault, self._steps = session, fault, 0

    def __getattr__(self, name):
        return getattr(self._session, name)

    def next(self, *args, **kwargs):
        self._steps += 1
        self._fault(self._steps)
        return self._session.next(*args, **kwargs)


def dies_after(steps: int) -> Callable[[int], None]:
    def fault(step: int) -> None:
        if step > steps:
            raise RuntimeError("the draft died")
    return fault
