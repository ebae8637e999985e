"""Real gRPC services on loopback for the service tests: draft and target servers run on
an event loop in a background thread (in-process grpc.aio servers, real sockets), so each
test drives them through real channels from its own event loop."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest

from services.common.settings import DraftSettings, TargetSettings
from services.draft.main import start as start_draft
from services.draft.servicer import DraftServicer
from services.target.main import start as start_target
from services.target.servicer import TargetServicer
from specd.drafters import build_drafter
from specd.runtime.tiny import char_tokenizer, loaded, perturbed, tiny_llama


class LoopThread:
    """An asyncio loop in a daemon thread; run(coro) waits for a coroutine on it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def eventually(check, timeout_s: float = 5.0) -> None:
    """Server-side bookkeeping runs as a call unwinds, which may be just after the client saw
    the call end: wait for it."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the service did not record it"
        time.sleep(0.01)


@dataclass
class Service:
    address: str
    servicer: object
    server: object
    loop: LoopThread

    def stop(self):
        self.loop.run(self.server.stop(0))
        if hasattr(self.servicer, "close"):
            self.loop.loop.call_soon_threadsafe(self.servicer.close)


@pytest.fixture(scope="session")
def service_loop():
    loop = LoopThread()
    yield loop
    loop.stop()


@pytest.fixture(scope="session")
def chat_pair():
    """A tiny target and a 1%-noise draft with the character tokenizer (chat template included)."""
    tok = char_tokenizer()
    target = loaded(tiny_llama(0, layers=4, vocab_size=len(tok)), "tiny-chat-target", tok)
    draft = loaded(perturbed(target.model, 0.01, seed=1), "tiny-chat-draft", tok)
    return target, draft


@pytest.fixture(scope="session")
def target_service(service_loop, chat_pair):
    servicer = TargetServicer(chat_pair[0])
    server, port = service_loop.run(start_target(TargetSettings(port=0), servicer))
    svc = Service(f"127.0.0.1:{port}", servicer, server, service_loop)
    yield svc
    svc.stop()


def draft_service(loop: LoopThread, drafter, model, **options) -> Service:
    servicer = DraftServicer(drafter, model, **options)
    server, port = loop.run(start_draft(DraftSettings(port=0), servicer))
    return Service(f"127.0.0.1:{port}", servicer, server, loop)


@pytest.fixture(scope="session")
def hf_draft_service(service_loop, chat_pair):
    _, draft = chat_pair
    svc = draft_service(service_loop, build_drafter("hf", draft, draft), draft)
    yield svc
    svc.stop()


@pytest.fixture(scope="session")
def ngram_draft_service(service_loop):
    svc = draft_service(service_loop, build_drafter("ngram", None), None)
    yield svc
    svc.stop()
