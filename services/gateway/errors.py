"""The one place where errors become OpenAI's error JSON:
`{"error": {"message", "type", "param", "code"}}` with the matching HTTP status.

Routes raise typed errors (specd.errors, Unauthorized) or let the backend raise them; the
handler installed by `install` maps each to a status. `param` uses the REST request's names:
the engine's own field names are translated in `rest_param`.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from specd.errors import InvalidRequest, Overloaded, Unavailable

log = logging.getLogger(__name__)


class Unauthorized(Exception):
    """The request has no API key, or an unknown one."""


class RateLimited(Exception):
    """The request's API key is over one of its limits; kind: requests, tokens or concurrent
    (OpenAI's error type: requests or tokens); headers: Retry-After and x-ratelimit-*."""

    def __init__(self, message: str, kind: str, headers: dict[str, str]):
        super().__init__(message)
        self.kind, self.headers = kind, headers


# Engine field name -> REST parameter name (exact names first, then prefixes).
_PARAM_NAMES = {
    "max_new_tokens": "max_tokens",
    "policy": "speculative.policy",
    "max_draft_tokens": "speculative.max_draft_tokens",
    "policy_params.max_draft_tokens": "speculative.max_draft_tokens",  # the engine merges it in
    "relaxed": "speculative.relaxed",
    "branches": "speculative.branches",
    "task_tag": "speculative.task_tag",
    "policy_params": "speculative.params",
}
_PARAM_PREFIXES = {"policy_params.": "speculative.params."}
# Parts of a pydantic error location that name a union member's type, not a field.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def rest_param(field: str, path: str) -> str:
    """The REST name of an engine field; `prompt` is `messages` on the chat route."""
    if field == "prompt":
        return "messages" if path.endswith("/chat/completions") else "prompt"
    if field in _PARAM_NAMES:
        return _PARAM_NAMES[field]
    for old, new in _PARAM_PREFIXES.items():
        if field.startswith(old):
            return new + field[len(old):]
    return field


def describe(exc: Exception, request: Request) -> tuple[int, dict[str, Any]]:
    """(HTTP status, error JSON) for any exception; also used for errors inside a stream."""
    if isinstance(exc, InvalidRequest):
        param = rest_param(exc.field, request.url.path)
        return 400, _body(f"{param}: {exc.message}", "invalid_request_error", param)
    if isinstance(exc, RequestValidationError):
        message, param = _validation_message(exc)
        return 400, _body(message, "invalid_request_error", param)
    if isinstance(exc, Unauthorized):
        return 401, _body(str(exc), "invalid_request_error", code="invalid_api_key")
    if isinstance(exc, RateLimited):
        kind = "tokens" if exc.kind == "tokens" else "requests"  # OpenAI's types; concurrency counts requests
        return 429, _body(str(exc), kind, code="rate_limit_exceeded")
    if isinstance(exc, Overloaded):  # a service is at capacity (KV slots): not this client's fault
        return 503, _body(str(exc) or "the server is at capacity; retry later", "server_error",
                          code="overloaded")
    if isinstance(exc, Unavailable):
        return 503, _body(str(exc) or "the model service is unavailable", "server_error",
                          code="service_unavailable")
    if isinstance(exc, ClientDisconnect):  # nobody reads this; 499 counts it in the metrics
        return 499, _body("client closed the request", "invalid_request_error")
    if isinstance(exc, HTTPException):
        if exc.status_code == 404:
            return 404, _body(f"Invalid URL ({request.method} {request.url.path})", "invalid_request_error")
        return exc.status_code, _body(str(exc.detail), "invalid_request_error")
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return 500, _body("internal server error", "server_error")


RETRY_AFTER_S = "1"


async def handle(request: Request, exc: Exception) -> JSONResponse:
    status, body = describe(exc, request)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    if status in (429, 503):  # refused at once: say when to come back rather than hold the client
        headers = {"Retry-After": RETRY_AFTER_S}
    if isinstance(exc, RateLimited):
        headers = exc.headers
    return JSONResponse(body, status_code=status, headers=headers)


def too_large(max_bytes: int) -> HTTPException:
    """The error for a request body over the gateway's limit (413)."""
    return HTTPException(413, f"the request body is larger than this server's limit of {max_bytes} bytes")


def too_large_response(max_bytes: int) -> JSONResponse:
    exc = too_large(max_bytes)
    return JSONResponse(_body(exc.detail, "invalid_request_error", code="request_too_large"), status_code=413)


def install(app: FastAPI) -> None:
    for exc_class in (InvalidRequest, RequestValidationError, Unauthorized, RateLimited, Overloaded,
                      Unavailable, ClientDisconnect, HTTPException, Exception):
        app.add_exception_handler(exc_class, handle)


def _body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One clear sentence for pydantic's error list: the first failing field, with every
    reason given for it (a union reports one per member)."""
    errors = exc.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", "parse error")
        return f"the request body is not valid JSON ({detail})", None
    param = _loc_param(first["loc"])
    reasons = dict.fromkeys(_reason(e) for e in errors if _loc_param(e["loc"]) == param)
    if param is None:
        return ("the request body must be a JSON object, sent with Content-Type: application/json "
                f"({' or '.join(reasons)})"), None
    return f"{param}: {' or '.join(reasons)}", param


def _loc_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc[1:] if isinstance(p, int) or not _is_type_tag(p)]  # loc[0] is "body"
    return ".".join(parts) or None


def _is_type_tag(part: str) -> bool:
    return part in _TYPE_TAGS or "[" in part or part[:1].isupper()


def _reason(error: dict) -> str:
    return error["msg"].removeprefix("Value error, ")
