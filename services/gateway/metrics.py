"""Prometheus series of the gateway, on a registry of its own per app (so that several apps
in one process, as in tests, do not collide).

Request rate by route and status, e.g. the error ratio:
  sum(rate(specd_gateway_requests_total{status=~"5.."}[5m])) / sum(rate(specd_gateway_requests_total[5m]))
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

UNMATCHED = "unmatched"  # route label of requests no route matched (bounded cardinality)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("specd_gateway_requests", "HTTP requests by route template and status",
                                ["route", "status"], registry=self.registry)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestCounter:
    """ASGI middleware counting each HTTP request once its status is known (a stream counts
    when its headers go out). Pure ASGI, not BaseHTTPMiddleware, so that streaming responses
    and client disconnects pass through untouched."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        counted = False

        def count(status: int) -> None:
            nonlocal counted
            if not counted:
                counted = True
                route = getattr(scope.get("route"), "path", UNMATCHED)
                self.metrics.requests.labels(route, str(status)).inc()

        async def send_counting(message: Message) -> None:
            if message["type"] == "http.response.start":
                count(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        except Exception:
            count(500)  # the outermost error middleware turns it into a 500
            raise
