"""The OpenAI-compatible REST gateway (docs/services.md, "The protocol"): FastAPI routes over a Backend.

Routes only translate: JSON -> GenerateRequest (convert) -> backend.generate -> JSON or
Server-Sent Events. Errors are raised, never handled here; `errors.install` maps them.

Two rules keep streams honest:
- the first backend event is awaited before any response starts, so a bad parameter (which
  the backend reports before its first event) is a 400, not a broken stream;
- the backend iterator is always closed when the response ends: on [DONE] or the full answer,
  on a client disconnect (http.disconnect from the ASGI server: Starlette cancels a stream;
  `_collect` watches for it itself), or on cancellation, so that the backend frees the
  request's KV caches at once.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPBearer
from prometheus_client import CollectorRegistry
from pydantic import BaseModel
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from services.coordinator.api import Backend, Event, FinishEvent
from services.gateway import convert, errors
from services.gateway.auth import Auth, KeyedRoute
from services.gateway.body_limit import BodyLimit
from services.gateway.keys import KeyRing
from services.gateway.limits import Limiter
from services.gateway.metrics import GatewayMetrics, RequestCounter
from services.gateway.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    ModelList,
)
from specd import __version__
from specd.errors import Overloaded, Unavailable


class Admission:
    """At most `limit` generations in flight on this gateway (0: no limit); one more is refused
    at once with Overloaded (503 and Retry-After), never queued. The routes run on one event
    loop, so a plain counter is enough. Once `draining` (shutting down), every new generation
    is refused with Unavailable (503 and Retry-After) while those in flight finish."""

    def __init__(self, limit: int = 0):
        self.limit, self.in_flight = limit, 0
        self.draining = False

    def enter(self) -> Callable[[], None]:
        """Count a generation in; returns its release, which is safe to call more than once."""
        if self.draining:
            raise Unavailable("the gateway is shutting down; retry the request")
        if self.limit and self.in_flight >= self.limit:
            raise Overloaded(f"the gateway is serving its limit of {self.limit} concurrent requests")
        self.in_flight += 1
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self.in_flight -= 1

        return release


@dataclass(frozen=True)
class Gateway:
    """Everything the routes need, fixed at start-up."""

    backend: Backend
    max_tokens_limit: int
    default_policy: str
    auth: Auth
    metrics: GatewayMetrics
    started: int  # unix time, the models' `created`
    admission: Admission = field(default_factory=Admission)


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(_gateway)]
_bearer = HTTPBearer(auto_error=False)  # documents the scheme; KeyedRoute checks the key before the body


_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 429, 500, 503)}
v1 = APIRouter(prefix="/v1", dependencies=[Depends(_bearer)], responses=_ERRORS, route_class=KeyedRoute)
ops = APIRouter()


# -- routes -----------------------------------------------------------------------------------

@v1.post("/chat/completions", response_model=ChatCompletion,
         description="OpenAI chat completions; `stream: true` answers with Server-Sent Events.")
async def chat_completions(body: ChatCompletionRequest, request: Request, gw: GatewayDep):
    return await _complete(gw, body, request, chat=True)


@v1.post("/completions", response_model=Completion,
         description="OpenAI (legacy) completions; `stream: true` answers with Server-Sent Events.")
async def completions(body: CompletionRequest, request: Request, gw: GatewayDep):
    return await _complete(gw, body, request, chat=False)


@v1.get("/models")
async def models(gw: GatewayDep) -> ModelList:
    return convert.model_list(gw.backend.model_card(), gw.started)


HEALTH_TIMEOUT_S = 0.9  # /health answers within a second, whatever the backend does


@ops.get("/health")
async def health(gw: GatewayDep) -> JSONResponse:
    """200 {"status": "ok"} when the backend is ready; 503 "unavailable" when it is not (or does
    not say within HEALTH_TIMEOUT_S), 503 "draining" while shutting down. No details: probes
    and clients learn nothing of the internal addresses."""
    if gw.admission.draining:
        return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": errors.RETRY_AFTER_S})
    try:
        ok = await asyncio.wait_for(gw.backend.ready(), HEALTH_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - a backend that cannot say is not ready
        ok = False
    return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)


@ops.get("/metrics")
async def prometheus_metrics(gw: GatewayDep) -> Response:
    body, content_type = gw.metrics.render()
    return Response(body, media_type=content_type)


# -- one generation ---------------------------------------------------------------------------

async def _complete(gw: Gateway, body: convert.Request, request: Request, chat: bool):
    release = gw.admission.enter()  # over the limit: 503 at once, before any work
    streaming = False
    try:
        gen = convert.generate_request(body, default_policy=gw.default_policy,
                                       max_tokens_limit=gw.max_tokens_limit)
        # Over the key's limits: 429 at once. The lease ends the admission and the key's lease.
        lease = await gw.auth.admit(request, gen.sampling.max_new_tokens, release)
        release = lease.close
        events = gw.backend.generate(gen)
        try:
            first = await anext(events)  # a bad request raises here, before any byte is sent
        except BaseException:
            lease.used = 0  # nothing generated: the key gets its tokens back
            await _aclose(events)
            raise
        env = convert.Envelope.new(chat, gw.backend.model_card().id)
        if body.stream:
            to_chunks = convert.chat_chunks if chat else convert.completion_chunks
            head = convert.chat_head(env) if chat else []
            streaming = True  # the stream releases its admission when it ends, however it ends
            return EventStream(_sse(request, events, first, head,
                                    lambda event: to_chunks(env, lease.observe(event), body.include_usage)),
                               on_close=release)
        try:
            text, finish = await _collect(request, first, events)
        finally:
            await _aclose(events)
        lease.observe(finish)
        return convert.chat_completion(env, text, finish) if chat else convert.completion(env, text, finish)
    finally:
        if not streaming:
            release()


async def _collect(request: Request, first: Event, events: AsyncIterator[Event]) -> tuple[str, FinishEvent]:
    """The whole answer, or ClientDisconnect as soon as the client leaves: nobody would read
    it, and closing the backend iterator frees the session now rather than at the end."""
    with anyio.CancelScope() as scope:
        watcher = asyncio.ensure_future(_cancel_on_disconnect(request, scope))
        try:
            parts, event = [], first
            while not isinstance(event, FinishEvent):
                parts.append(event.text)
                event = await anext(events)
            return "".join(parts), event
        finally:
            watcher.cancel()
    raise ClientDisconnect()  # reached only when the watcher cancelled the scope


async def _cancel_on_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _sse(request: Request, events: AsyncIterator[Event], first: Event, head: list[BaseModel],
               chunks: Callable[[Event], list[BaseModel]]) -> AsyncIterator[str]:
    """`data: {json}` per chunk, then `data: [DONE]`; an error after the stream started can
    only be reported in-stream, as OpenAI does: `data: {"error": ...}`."""
    try:
        for chunk in head:
            yield _data(chunk.model_dump_json())
        event = first
        while True:
            for chunk in chunks(event):
                yield _data(chunk.model_dump_json())
            if isinstance(event, FinishEvent):
                break
            event = await anext(events)
        yield _data("[DONE]")
    except Exception as exc:  # noqa: BLE001 - any error, once streaming, can only go in-stream
        _, body = errors.describe(exc, request)
        yield _data(json.dumps(body))
    finally:
        await _aclose(events)


def _data(payload: str) -> str:
    return f"data: {payload}\n\n"


async def _aclose(events: AsyncIterator[Event]) -> None:
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()


class EventStream(StreamingResponse):
    """A Server-Sent Events response that closes its body iterator (and so the backend's)
    whenever the response ends, however it ends."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None] = lambda: None):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                with anyio.CancelScope(shield=True):
                    await self.body_iterator.aclose()
            finally:
                self.on_close()


# -- the app ----------------------------------------------------------------------------------

def create_app(backend: Backend, *, max_tokens_limit: int = 4096, default_policy: str = "cost-aware",
               api_keys: frozenset[str] = frozenset(), registry: CollectorRegistry | None = None,
               max_concurrent_requests: int = 0, max_body_bytes: int = 4 << 20, keys: KeyRing | None = None,
               limiter: Limiter | None = None) -> FastAPI:
    """The gateway over `backend`. max_concurrent_requests: generations in flight beyond which
    a request is refused at once (503, Retry-After; 0: no limit). max_body_bytes: a larger
    request body is refused with 413 before it is read (0: no limit). With keys (a KeyRing) or
    api_keys (static keys), /v1 routes need `Authorization: Bearer <key>`, checked before the body
    is read, and each key's limits apply (limiter: shared by replicas through Redis; default: this
    process's memory); without either the API is open. /health and /metrics stay open for probes
    and Prometheus. /metrics serves `registry` (an
    in-process coordinator's series go there too), a new one by default."""
    app = FastAPI(title="specd gateway", version=__version__,
                  description="OpenAI-compatible API over speculative decoding. Per-request speculation "
                              "settings go in the `speculative` body field; each response carries "
                              "`spec_stats` beside `usage` (in the final chunk when streaming).")
    metrics = GatewayMetrics(registry)
    if keys is None and api_keys:
        keys = KeyRing(static_keys=sorted(api_keys))
    auth = Auth(keys, limiter, metrics)
    app.state.gateway = Gateway(backend, max_tokens_limit, default_policy, auth, metrics, int(time.time()),
                                Admission(max_concurrent_requests))
    app.include_router(v1)
    app.include_router(ops)
    errors.install(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(RequestCounter, metrics=metrics)
    return app
