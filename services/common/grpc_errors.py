"""One place that maps specd's typed errors to gRPC statuses (servers) and back (clients),
so that servicers hold no error handling (STYLE.md habit 4).

InvalidRequest -> INVALID_ARGUMENT with the message "field: what is wrong"; Overloaded ->
RESOURCE_EXHAUSTED; Unavailable -> UNAVAILABLE; ModelError -> FAILED_PRECONDITION; any
other exception -> INTERNAL (logged with its traceback).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from specd.errors import InvalidRequest, ModelError, Overloaded, SpecdError, Unavailable

log = logging.getLogger(__name__)

_CODES: list[tuple[type[SpecdError], grpc.StatusCode]] = [
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (ModelError, grpc.StatusCode.FAILED_PRECONDITION),
]


def status_of(e: BaseException) -> tuple[grpc.StatusCode, str]:
    for cls, code in _CODES:
        if isinstance(e, cls):
            return code, str(e)
    log.exception("internal error", exc_info=e)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}"


def from_rpc_error(e: grpc.aio.AioRpcError, service: str) -> SpecdError:
    """A failed call to another service as the core's typed error."""
    code, details = e.code(), e.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field, sep, message = details.partition(": ")
        return InvalidRequest(field, message) if sep else InvalidRequest("request", details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(f"{service}: {details}")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return ModelError(f"{service}: {details}")
    return Unavailable(f"{service} service: {code.name.lower()}: {details}")


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler: a raised error becomes the matching status, never a traceback."""

    async def intercept_service(self, continuation: Callable[..., Awaitable[grpc.RpcMethodHandler]],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _streaming(handler.unary_stream), handler.request_deserializer, handler.response_serializer)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                _streaming(handler.stream_stream), handler.request_deserializer, handler.response_serializer)
        return handler


def _unary(behavior):
    async def wrapper(request, context: grpc.aio.ServicerContext):
        try:
            return await behavior(request, context)
        except SpecdError as e:
            await context.abort(*status_of(e))
        except Exception as e:
            if isinstance(e, grpc.aio.AbortError):
                raise
            await context.abort(*status_of(e))

    return wrapper


def _streaming(behavior):
    async def wrapper(request, context: grpc.aio.ServicerContext) -> AsyncIterator:
        responses = behavior(request, context)
        try:
            async for response in responses:
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001
            await context.abort(*status_of(e))
        finally:
            # `async for` does not close what it iterates: without this, a cancelled call's
            # handler (and the KV cache it frees in its finally) waits for the garbage collector.
            await responses.aclose()

    return wrapper
