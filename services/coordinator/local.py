"""`LocalBackend`: the Backend protocol over the in-process SpeculativeEngine, for a
single-process deployment and for tests of the gateway.

Model compute runs on one worker thread (a single-thread executor), so requests are
serialized round by round while the event loop stays free for HTTP; a request that asks for
PEARL (`overlap`) drafts on a thread of its own besides (specd.speculation.overlap). Every step of a request
(tokenize + validate + allocate the KV caches, each round, closing) is a job on that thread;
because its queue is FIFO, the close job submitted when a client goes away runs right after
the round in flight, never concurrently with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from services.coordinator.api import (
    Event,
    FinishEvent,
    GenerateRequest,
    ModelCard,
    TokenEvent,
    named_logprobs,
)
from specd.detok import TextStream
from specd.tools import call_tokens, template_format
from specd.engine import GenerationRun, SpeculativeEngine


class _Session:
    """One request's run, or None before it opens and after it closes; touched only on the
    worker thread."""

    def __init__(self) -> None:
        self.run: GenerationRun | None = None


class LocalBackend:
    def __init__(self, engine: SpeculativeEngine):
        self.engine = engine
        self.target = engine.target
        # Changed on the worker thread only: runs holding KV caches, and runs closed before
        # they finished (the client went away).
        self.active_sessions = 0
        self.cancelled_sessions = 0
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specd-engine")

    def model_card(self) -> ModelCard:
        drafter = self.engine.drafter
        return ModelCard(self.target.name, self.target.max_context, drafter.name if drafter else None,
                         template_format(self.target.tokenizer) if self.target.tokenizer is not None else None)

    async def ready(self) -> bool:
        return True

    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        return self._generate(request)

    async def close(self) -> None:
        """Stop the worker thread once the jobs already queued (closes included) have run."""
        await asyncio.get_running_loop().run_in_executor(None, self._worker.shutdown)

    # -- one request ------------------------------------------------------------------------
    async def _generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        session = _Session()
        try:
            # Raises InvalidRequest here, before the first event, for a bad prompt or parameter.
            run = await self._call(self._open, session, request)
            stream = TextStream(self.target.tokenizer, request.sampling.stop,
                                call_tokens(self.target.tokenizer) if request.tools_json else None)
            rounds = iter(run)
            while not stream.stopped:
                new = await self._call(next, rounds, None)
                if new is None:
                    break
                released = len(stream.ids)  # the index of new[0] among the generated ids
                delta = stream.push(new)
                if delta.token_ids or delta.text:
                    lps = (named_logprobs(self.target.tokenizer, delta.token_ids,
                                          run.logprobs[released:released + len(delta.token_ids)])
                           if request.logprobs is not None else ())
                    yield TokenEvent(delta.token_ids, delta.text, lps)
            tail = stream.finish()
            if tail.text:
                yield TokenEvent((), tail.text)
            await self._call(self._close, session)  # finalizes the statistics
            yield FinishEvent("stop" if stream.stopped else run.finish_reason or "length",
                              run.prompt_len, len(stream.ids), {"fallback": False, **run.stats.to_dict()})
        finally:
            # Also reached on aclose() and cancellation (client gone): queue the close behind
            # the round in flight without waiting for it. Idempotent after a normal finish.
            self._worker.submit(self._close, session)

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    def _open(self, session: _Session, request: GenerateRequest) -> GenerationRun:
        request.validate()
        run = self.engine.start(self._prompt_ids(request), request.sampling, request.spec,
                                logprobs=request.logprobs, overlap=bool(request.overlap))
        session.run = run
        self.active_sessions += 1
        return run

    def _close(self, session: _Session) -> None:
        if session.run is not None:
            if session.run.finish_reason is None:
                self.cancelled_sessions += 1
            session.run.close()
            session.run = None
            self.active_sessions -= 1

    def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.prompt_ids is not None:
            return list(request.prompt_ids)
        if request.messages is not None:
            return self.target.encode_prompt([dict(m) for m in request.messages], chat=True,
                                             tools=request.tool_specs())
        return self.target.encode_prompt(request.prompt or "", chat=False)
