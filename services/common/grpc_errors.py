"""One place that maps specd's typed errors to gRPC statuses (servers) and back (clients),
so that servicers hold no error handling: they only translate.

InvalidRequest -> INVALID_ARGUMENT with the message "field: what is wrong"; Overloaded ->
RESOURCE_EXHAUSTED; Unavailable -> UNAVAILABLE; ModelError -> FAILED_PRECONDITION; any
other exception -> INTERNAL (logged with its traceback).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from specd.errors import Idle, InvalidRequest, ModelError, Overloaded, SpecdError, Unavailable

log = logging.getLogger(__name__)

_CODES: list[tuple[type[SpecdError], grpc.StatusCode]] = [
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (ModelError, grpc.StatusCode.FAILED_PRECONDITION),
    (Idle, grpc.StatusCode.DEADLINE_EXCEEDED),
]


def status_of(e: BaseException) -> tuple[grpc.StatusCode, str]:
    for cls, code in _CODES:
        if isinstance(e, cls):
            return code, str(e)
    log.exception("internal error", exc_info=e)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}"


def from_rpc_error(e: grpc.aio.AioRpcError, service: str) -> SpecdError:
    """A failed call to another service as the core's typed error."""
    return status_error(e.code(), e.details() or "", service)


def status_error(code: grpc.StatusCode, details: str, service: str) -> SpecdError:
    """A call's final status (not OK) as the core's typed error; only the status details are
    kept, never the call's debug string (it carries internal addresses), and only where they
    are a client-facing text (client_details)."""
    details = client_details(code, details, service)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field, sep, message = details.partition(": ")
        return InvalidRequest(field, message) if sep else InvalidRequest("request", details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(f"{service}: {details}")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return ModelError(f"{service}: {details}")
    return Unavailable(f"{service} service: {code.name.lower()}" + (f": {details}" if details else ""))


# An allowlist, not a filter: details reach a client only where they are a text specd's own
# services write. A deny-list of address patterns missed host names ("DNS resolution failed for
# target:50062") and TLS alerts; gRPC core, proxies and resolvers say whatever they like.
# - The codes the services' typed errors map to (status_of): their messages name a field or a
#   limit, never a peer; still refused where they look like an address.
_SERVICE_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                  grpc.StatusCode.FAILED_PRECONDITION}
# - Known texts of the other codes: the services' and the coordinator's own.
_KNOWN_TEXTS = [re.compile(p) for p in (
    r"(target|draft|coordinator) service: [a-z_]+",  # status_error's own
    r"(target|draft|coordinator) service ended the session",
    r"(target|draft|coordinator) service: the session ended \(\w+\)",
    r"target service: no verdict within \d+(\.\d+)? s",
    r"target service answered a verification nobody asked for",
    r"internal error: \w+",  # status_of
    r"missing or wrong bearer token \(authorization metadata\)",  # security.TokenInterceptor
    r"session: no message for \d+(\.\d+)? s \(idle_timeout_s\)",  # the target's idle sessions
)]
_RELAYED = re.compile(r"(target|draft|coordinator) service: [a-z_]+: (.+)")  # a coordinator's, relayed
_ADDRESS = re.compile(r"ipv[46]:|unix:|dns:|\d{1,3}(\.\d{1,3}){3}|\[[0-9a-fA-F:]*:[0-9a-fA-F:]*\]"
                      r"|[A-Za-z0-9.-]+:\d{2,5}\b|%5B", re.IGNORECASE)


def _known(details: str) -> bool:
    if any(p.fullmatch(details) for p in _KNOWN_TEXTS):
        return True
    relayed = _RELAYED.fullmatch(details)
    return relayed is not None and _known(relayed.group(2))


def client_details(code: grpc.StatusCode, details: str, service: str) -> str:
    """details where a client may read them, else "" (the caller then names only the code);
    what is dropped goes to the log, for the operator."""
    if (code in _SERVICE_CODES and not _ADDRESS.search(details)) or _known(details):
        return details
    if details:
        log.warning("%s service: %s: %s", service, code.name, details)
    return ""


def client_message(e: BaseException, service: str) -> str:
    """What a client (an API answer, spec_stats.fallback_reason) may read of an error: a typed
    error's own text (status_error built it from the allowlist, or specd wrote it), a failed
    call's allowlisted status, else a generic text naming the kind of error."""
    if isinstance(e, grpc.aio.AioRpcError):
        return str(from_rpc_error(e, service))
    if isinstance(e, SpecdError):
        return str(e)
    log.warning("%s service: %s: %s", service, type(e).__name__, e)
    return f"{service} service: the session ended ({type(e).__name__})"


Observe = Callable[[str, str, float], None]  # (method, status code name, seconds) when a call ends


def _ignore(method: str, code: str, seconds: float) -> None:
    pass


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler: a raised error becomes the matching status, never a traceback.
    With `observe`, each call's method, final status and duration are reported when it ends
    (services.common.metrics.RpcMetrics)."""

    def __init__(self, observe: Observe | None = None):
        self.observe = observe or _ignore

    async def intercept_service(self, continuation: Callable[..., Awaitable[grpc.RpcMethodHandler]],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method, observe = details.method, self.observe
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _unary(handler.unary_unary, method, observe), handler.request_deserializer,
                handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _streaming(handler.unary_stream, method, observe), handler.request_deserializer,
                handler.response_serializer)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                _streaming(handler.stream_stream, method, observe), handler.request_deserializer,
                handler.response_serializer)
        return handler


class _Outcome:
    """Around one call: an error becomes its status (context.abort), and the call's final
    status code and duration are reported to observe when it ends, however it ends."""

    def __init__(self, method: str, observe: Observe, context: grpc.aio.ServicerContext):
        self.method, self.observe, self.context = method, observe, context
        self.start = time.perf_counter()

    async def __aenter__(self) -> None:
        pass

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        code = "OK"
        try:
            if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
                code = "CANCELLED"
            elif isinstance(exc, grpc.aio.AbortError):
                code = _aborted_code(self.context)
            elif isinstance(exc, Exception):
                status = status_of(exc)
                code = status[0].name
                await self.context.abort(*status)  # raises AbortError in place of exc
            return False
        finally:
            self.observe(self.method, code, time.perf_counter() - self.start)


def _unary(behavior, method: str, observe: Observe):
    async def wrapper(request, context: grpc.aio.ServicerContext):
        async with _Outcome(method, observe, context):
            return await behavior(request, context)

    return wrapper


def _streaming(behavior, method: str, observe: Observe):
    if inspect.iscoroutinefunction(behavior):  # writes its responses itself (context.write), as Health.Watch
        async def writer(request, context: grpc.aio.ServicerContext) -> None:
            async with _Outcome(method, observe, context):
                await behavior(request, context)

        return writer

    async def wrapper(request, context: grpc.aio.ServicerContext) -> AsyncIterator:
        responses = behavior(request, context)
        try:
            async with _Outcome(method, observe, context):
                async for response in responses:
                    yield response
        finally:
            # `async for` does not close what it iterates: without this, a cancelled call's
            # handler (and the KV cache it frees in its finally) waits for the garbage collector.
            await responses.aclose()

    return wrapper


def _aborted_code(context: grpc.aio.ServicerContext) -> str:
    code = context.code()
    return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
