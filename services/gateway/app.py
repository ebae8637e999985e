"""The OpenAI-compatible REST gateway (docs/services.md, "The protocol"): FastAPI routes over a Backend.

Routes only translate: JSON -> GenerateRequest (convert) -> backend.generate -> JSON or
Server-Sent Events. Errors are raised, never handled here; `errors.install` maps them.

Bodies over PARSE_OFF_LOOP_BYTES are parsed and validated in a worker thread by a pure-Python
JSON scanner, which yields the GIL as it goes (the C one holds it for the whole body) and stops
at a list longer than any field may hold (json_scan), at most max_concurrent_parses at a time
(one more: 503 and Retry-After): a large hostile body then delays no other client's stream or
/health.

A stream whose client takes nothing for stream_send_timeout_s (it stopped reading: a send
waits, or its bytes wait in the connection's buffers, services.gateway.reader) is ended as a
disconnect is: the backend iterator is closed and the admission and lease released.

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
import dataclasses
import email.message
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from services.coordinator.api import Backend, Event, FinishEvent, Logprob
from services.gateway import convert, errors, json_scan
from services.gateway.auth import Auth, KeyedRoute
from services.gateway.body_limit import BodyLimit
from services.gateway.keys import KeyRing
from services.gateway.limits import Limiter
from services.gateway.metrics import GatewayMetrics, RequestCounter, key_label
from services.gateway.reader import ReaderWatch
from specd.tools import HERMES
from services.gateway.schemas import (
    MAX_MESSAGES,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    ModelList,
)
from specd import __version__
from specd.errors import Overloaded, Unavailable

log = logging.getLogger(__name__)

PARSE_OFF_LOOP_BYTES = 64 << 10  # smaller bodies parse on the loop in well under a millisecond
MAX_BODY_ITEMS = MAX_MESSAGES  # the longest list or object any field of a request may hold

class Admission:
    """At most `limit` generations in flight on this gateway (0: no limit); one more is refused
    at once with Overloaded (503 and Retry-After), never queued. The routes run on one event
    loop, so plain counters are enough. Once `draining` (shutting down), every new generation
    is refused with Unavailable (503 and Retry-After) while those in flight finish.

    Between API keys (docs/deploy.md, "Security"): a key without a concurrency limit of its own
    holds at most `per_key` generations here (0: no cap), and the last `reserve` of the slots go
    only to keys holding less than a fair share (the slots over the keys in flight and one
    more), so that a key arriving at a gateway another key fills still gets in. Both refusals
    are the key's: 429 and Retry-After. Requests without a key (an open API) share one count."""

    def __init__(self, limit: int = 0, per_key: int = 0, reserve: float = 0.125):
        self.limit, self.per_key, self.in_flight = limit, per_key, 0
        self.reserve = math.ceil(limit * reserve) if limit else 0
        self.by_key: dict[str, int] = {}
        self.draining = False

    def enter(self, key: str | None = None, own_limit: int = 0) -> Callable[[], None]:
        """Count a generation in (key: its API key's name; own_limit: that key's own concurrency
        limit, enforced across replicas by the limiter); returns its release, safe to call more
        than once."""
        if self.draining:
            raise Unavailable("the gateway is shutting down; retry the request")
        if self.limit and self.in_flight >= self.limit:
            raise Overloaded(f"the gateway is serving its limit of {self.limit} concurrent requests")
        if key is not None:
            self._check_share(key, own_limit)
            self.by_key[key] = self.by_key.get(key, 0) + 1
        self.in_flight += 1
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self.in_flight -= 1
                if key is not None:
                    left = self.by_key[key] - 1
                    if left:
                        self.by_key[key] = left
                    else:
                        del self.by_key[key]

        return release

    def _check_share(self, key: str, own_limit: int) -> None:
        held = self.by_key.get(key, 0)
        if self.per_key and not own_limit and held >= self.per_key:
            raise _key_refusal(f"this API key has {held} requests in flight on this gateway, its limit of "
                               f"{self.per_key}")
        if self.limit and self.limit - self.in_flight <= self.reserve:
            fair = math.ceil(self.limit / (len(self.by_key) + 1))  # a share kept for one more key
            if held >= fair:
                raise _key_refusal(f"the gateway is nearly full and this API key holds {held} of its "
                                   f"{self.limit} slots, its fair share")


def _key_refusal(why: str) -> errors.RateLimited:
    return errors.RateLimited(f"{why}; retry when one finishes", "concurrent", {"Retry-After": errors.RETRY_AFTER_S})


def _validate(model: type[BaseModel], body: bytes) -> BaseModel | Exception:
    """The request model of body, or the error FastAPI itself would raise for it; a list or
    object longer than any a request holds stops the parse there (json_scan)."""
    try:
        obj = json_scan.decode(body.decode(json.detect_encoding(body), "surrogatepass"), MAX_BODY_ITEMS)
    except json_scan.TooManyItems as e:
        if not e.path:
            return HTTPException(400, f"the request body: {e}")
        return RequestValidationError([{"type": "too_long", "loc": ("body", *e.path), "msg": str(e), "input": None}])
    except json.JSONDecodeError as e:
        return RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                        "input": {}, "ctx": {"error": e.msg}}])
    except (UnicodeDecodeError, RecursionError):
        return HTTPException(400, "There was an error parsing the body")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        return RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)])


class BodyParser:
    """Parses large request bodies in worker threads, at most `limit` at once: one more is
    refused at once with Overloaded (503, Retry-After)."""

    def __init__(self, limit: int):
        self.limit, self.busy = limit, 0

    async def parse(self, model: type[BaseModel], body: bytes) -> BaseModel:
        if self.busy >= self.limit:
            raise Overloaded(f"the gateway is parsing its limit of {self.limit} large request bodies; retry")
        self.busy += 1
        try:
            result = await anyio.to_thread.run_sync(_validate, model, body)
        finally:
            self.busy -= 1
        if isinstance(result, Exception):
            raise result
        return result


def _json_content(content_type: str | None) -> bool:
    """Whether FastAPI reads a body of this content type as JSON (with its strict default)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


class _OffLoopBody(APIRoute):
    """A large JSON body is parsed and validated by the gateway's BodyParser before FastAPI
    sees it; FastAPI then finds the validated model as the request's JSON and keeps it as is."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()
        model = self.body_field.field_info.annotation if self.body_field is not None else None

        async def parse_first(request: Request) -> Response:
            if model is not None and _json_content(request.headers.get("content-type")):
                body = await request.body()
                if len(body) > PARSE_OFF_LOOP_BYTES:
                    request._json = await request.app.state.gateway.parser.parse(model, body)
            return await handler(request)

        return parse_first


class GatewayRoute(KeyedRoute, _OffLoopBody):
    """The key is checked first (KeyedRoute), then a large body parsed off the loop."""


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
    parser: BodyParser = field(default_factory=lambda: BodyParser(4))
    stream_send_timeout_s: float = 15.0


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(_gateway)]
_bearer = HTTPBearer(auto_error=False)  # documents the scheme; KeyedRoute checks the key before the body


_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 429, 500, 503)}
v1 = APIRouter(prefix="/v1", dependencies=[Depends(_bearer)], responses=_ERRORS, route_class=GatewayRoute)
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
    record = getattr(request.state, "api_key", None)  # authenticated before the body was read
    n = body.n or 1
    # Over the gateway's limit: 503 at once, before any work; over the key's share of it: 429.
    # Each of the n choices is a generation of its own (a KV slot each).
    release = _enter(gw.admission, record, n)
    streaming = False
    try:
        card = gw.backend.model_card()
        gen = convert.generate_request(body, default_policy=gw.default_policy,
                                       max_tokens_limit=gw.max_tokens_limit, tool_format=card.tool_format)
        tool_format = (card.tool_format or HERMES) if gen.tools_json else None  # the backend refuses tools it cannot
        # Over the key's limits: 429 at once. The lease ends the admission and the key's lease.
        lease = await gw.auth.admit(request, n * gen.sampling.max_new_tokens, release)
        lease.choices, release = n, lease.close
        gen = await gw.auth.scope_task_tag(request, gen)  # the key's own tags, capped (after admission)
        if record is not None:  # the target's fair share of KV slots is kept per key
            gen = dataclasses.replace(gen, tenant=key_label(record.name))
        sources = [gw.backend.generate(g) for g in convert.choices(gen, n)]
        try:  # a bad request raises here, before any byte is sent
            firsts = await asyncio.gather(*(anext(events) for events in sources), return_exceptions=True)
            failed = next((f for f in firsts if isinstance(f, BaseException)), None)
            if failed is not None:
                raise failed
        except BaseException:
            lease.used = 0  # nothing generated: the key gets its tokens back
            for events in sources:
                await _aclose(events)
            raise
        merged = _interleave([_chain(first, events) for first, events in zip(firsts, sources)])
        env = convert.Envelope.new(chat, card.id)
        if body.stream:
            per_choice = body.include_usage and n == 1  # n > 1: one usage chunk after every choice
            chunkers = [convert.stream_chunks(env, chat, per_choice, i, tool_format) for i in range(n)]
            head = convert.chat_head(env, n) if chat else []
            tail = (lambda finishes: [convert.usage_chunk(env, chat, finishes)]) if body.include_usage and n > 1 \
                else (lambda finishes: [])
            streaming = True  # the stream releases its admission when it ends, however it ends
            return EventStream(_sse(request, merged, head, lambda i, event: chunkers[i](lease.observe(event)), tail),
                               on_close=release, send_timeout_s=gw.stream_send_timeout_s)
        try:
            answers = await _collect(request, merged, n, lease.observe)
        finally:
            await _aclose(merged)
        for a in answers:
            lease.observe(a.finish)
        if gen.logprobs is None:
            answers = [dataclasses.replace(a, logprobs=None) for a in answers]
        if tool_format:
            answers = [a.with_calls(tool_format) for a in answers]
        return convert.chat_completion(env, answers) if chat else convert.completion(env, answers)
    finally:
        if not streaming:
            release()


def _enter(admission: Admission, record, n: int) -> Callable[[], None]:
    """n admissions of one request, all or none (each one's refusal as Admission.enter raises)."""
    releases: list[Callable[[], None]] = []
    try:
        for _ in range(n):
            releases.append(admission.enter(record.name if record is not None else None,
                                            record.limits.concurrent_requests if record is not None else 0))
    except BaseException:
        for r in releases:
            r()
        raise
    if n == 1:
        return releases[0]

    def release_all() -> None:
        for r in releases:
            r()

    return release_all


async def _chain(first: Event, events: AsyncIterator[Event]) -> AsyncIterator[Event]:
    """first, then the rest of events; closing it closes events."""
    try:
        yield first
        event = first
        while not isinstance(event, FinishEvent):  # the backend's last event: nothing follows
            event = await anext(events)
            yield event
    finally:
        await _aclose(events)


async def _interleave(sources: list[AsyncIterator[Event]]) -> AsyncIterator[tuple[int, Event]]:
    """(choice, event) of every source as it comes; closing it closes them all. Each source
    runs at most one event ahead of the reader, so a slow reader slows the generations."""
    if len(sources) == 1:
        try:
            async for event in sources[0]:
                yield 0, event
        finally:
            await _aclose(sources[0])
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(sources))
    done = object()

    async def pump(i: int, source: AsyncIterator[Event]) -> None:
        try:
            async for event in source:
                await queue.put((i, event))
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((i, e))
        finally:
            await _aclose(source)
        await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, source)) for i, source in enumerate(sources)]
    try:
        left = len(sources)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _collect(request: Request, merged: AsyncIterator[tuple[int, Event]], n: int,
                   observe=lambda event: event) -> list[convert.Answer]:
    """Every choice whole (its text, its finish, its tokens' log-probabilities), or
    ClientDisconnect as soon as the client leaves: nobody would read it, and closing the backend
    iterators frees the sessions now rather than at the end. observe: each token event, as it
    comes (the key's lease counts what a cut answer cost)."""
    parts: list[list[str]] = [[] for _ in range(n)]
    found: list[list[Logprob]] = [[] for _ in range(n)]
    finishes: list[FinishEvent | None] = [None] * n
    with anyio.CancelScope() as scope:
        watcher = asyncio.ensure_future(_cancel_on_disconnect(request, scope))
        try:
            async for i, event in merged:
                if isinstance(event, FinishEvent):
                    finishes[i] = event
                else:
                    parts[i].append(observe(event).text)
                    found[i] += event.logprobs
            return [convert.Answer("".join(p), f, lp) for p, f, lp in zip(parts, finishes, found)]
        finally:
            watcher.cancel()
    raise ClientDisconnect()  # reached only when the watcher cancelled the scope


async def _cancel_on_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _sse(request: Request, merged: AsyncIterator[tuple[int, Event]], head: list[BaseModel],
               chunks: Callable[[int, Event], list[BaseModel]],
               tail: Callable[[list[FinishEvent]], list[BaseModel]]) -> AsyncIterator[str]:
    """`data: {json}` per chunk, then `data: [DONE]`; an error after the stream started can
    only be reported in-stream, as OpenAI does: `data: {"error": ...}`. tail: the chunks after
    every choice finished."""
    try:
        for chunk in head:
            yield _data(chunk.model_dump_json())
        finishes = []
        async for i, event in merged:
            for chunk in chunks(i, event):
                yield _data(chunk.model_dump_json())
            if isinstance(event, FinishEvent):
                finishes.append(event)
        for chunk in tail(finishes):
            yield _data(chunk.model_dump_json())
        yield _data("[DONE]")
    except Exception as exc:  # noqa: BLE001 - any error, once streaming, can only go in-stream
        _, body = errors.describe(exc, request)
        yield _data(json.dumps(body))
    finally:
        await _aclose(merged)


def _data(payload: str) -> str:
    return f"data: {payload}\n\n"


async def _aclose(events: AsyncIterator[Event]) -> None:
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()


class SendTimeout(Exception):
    """The client took nothing within the stream's send timeout."""


class EventStream(StreamingResponse):
    """A Server-Sent Events response that closes its body iterator (and so the backend's)
    whenever the response ends, however it ends. One whose client takes nothing for
    send_timeout_s ends there (the ASGI server then drops the connection): a send that waits
    that long, or bytes that wait that long in the connection's buffers with none taken
    (services.gateway.reader), as they do for a client that stopped reading."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None] = lambda: None,
                 send_timeout_s: float | None = None):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close, self.send_timeout_s = on_close, send_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = ReaderWatch.of(scope, self.send_timeout_s)

        async def timed_send(message) -> None:
            if watch is not None and watch.stalled():
                raise SendTimeout()
            with anyio.move_on_after(self.send_timeout_s) as timer:
                await send(message)
            if timer.cancelled_caught:
                raise SendTimeout()
            if watch is not None:
                watch.wrote()

        try:
            try:
                await super().__call__(scope, receive, send if self.send_timeout_s is None else timed_send)
            except* SendTimeout:
                log.warning("ended a stream whose client took nothing for %s s", self.send_timeout_s)
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
               limiter: Limiter | None = None, max_concurrent_parses: int = 4,
               stream_send_timeout_s: float = 15.0, max_concurrent_per_key: int = 0,
               fair_share_reserve: float = 0.125) -> FastAPI:
    """The gateway over `backend`. max_concurrent_requests: generations in flight beyond which
    a request is refused at once (503, Retry-After; 0: no limit). max_body_bytes: a larger
    request body is refused with 413 before it is read (0: no limit). With keys (a KeyRing) or
    api_keys (static keys), /v1 routes need `Authorization: Bearer <key>`, checked before the body
    is read, and each key's limits apply (limiter: shared by replicas through Redis; default: this
    process's memory); without either the API is open. /health and /metrics stay open for probes
    and Prometheus. max_concurrent_parses: large bodies parsed at once (off the loop);
    stream_send_timeout_s: a stream whose client takes nothing this long is ended.
    max_concurrent_per_key, fair_share_reserve: the share of one key (Admission). /metrics serves
    `registry` (an in-process coordinator's series go there too), a new one by default."""
    app = FastAPI(title="specd gateway", version=__version__,
                  description="OpenAI-compatible API over speculative decoding. Per-request speculation "
                              "settings go in the `speculative` body field; each response carries "
                              "`spec_stats` beside `usage` (in the final chunk when streaming).")
    metrics = GatewayMetrics(registry)
    if keys is None and api_keys:
        keys = KeyRing(static_keys=sorted(api_keys))
    auth = Auth(keys, limiter, metrics)
    app.state.gateway = Gateway(backend, max_tokens_limit, default_policy, auth, metrics, int(time.time()),
                                Admission(max_concurrent_requests, max_concurrent_per_key, fair_share_reserve),
                                BodyParser(max_concurrent_parses),
                                stream_send_timeout_s)
    app.include_router(v1)
    app.include_router(ops)
    errors.install(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(RequestCounter, metrics=metrics)
    return app
