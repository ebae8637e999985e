"""Prometheus series of the gateway, served at its /metrics, on a registry of its own per app
(so that several apps in one process, as in tests, do not collide). When the gateway runs the
coordinator in-process, the coordinator's series (services.coordinator.metrics) are on the
same registry.

  specd_gateway_requests_total{route, status}     HTTP requests by route template and status
  specd_gateway_request_duration_seconds{route}   until the response (or the stream) ended
  specd_active_sessions{service="gateway"}        HTTP requests in progress
  specd_gateway_key_requests_total{key, outcome}  generation requests per API key: admitted,
                                                  rate_limited (requests, tokens or concurrent)
  specd_gateway_key_tokens_total{key}             completion tokens generated per API key
  specd_gateway_key_store_errors_total{op}        the key store (op="lookup") or the rate limiter
                                                  (op="limits") unreachable: limits not enforced

The `key` label is opaque, key_label(name): /metrics is open on the API port, and customers'
key names must not be read there. It is stable (every replica gives a key the same label), for
the first MAX_KEY_LABELS names a gateway sees, then "other" (bounded cardinality). An operator
maps a name to its label with `python -c "from services.gateway.metrics import key_label;
print(key_label('NAME'))"`.

PromQL: the error ratio, and p95 latency per route
  sum(rate(specd_gateway_requests_total{status=~"5.."}[5m])) / sum(rate(specd_gateway_requests_total[5m]))
  histogram_quantile(0.95, sum by (le, route) (rate(specd_gateway_request_duration_seconds_bucket[5m])))
"""

from __future__ import annotations

import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.metrics import LATENCY_BUCKETS, active_sessions, new_registry, opaque_label

UNMATCHED = "unmatched"  # route label of requests no route matched (bounded cardinality)
MAX_KEY_LABELS = 100  # API key names that get a label of their own; later ones share "other"
OTHER_KEYS = "other"


def key_label(name: str) -> str:
    """The opaque `key` label of a key name: "k" and 12 hex digits of its SHA-256."""
    return opaque_label("k", name)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or new_registry()
        self.active = 0
        self.requests = Counter("specd_gateway_requests", "HTTP requests by route template and status",
                                ["route", "status"], registry=self.registry)
        self.duration = Histogram("specd_gateway_request_duration_seconds",
                                  "HTTP request duration until its last byte was sent (or it ended)", ["route"],
                                  buckets=LATENCY_BUCKETS, registry=self.registry)
        self.key_requests = Counter("specd_gateway_key_requests",
                                    "generation requests per API key (opaque label) and outcome", ["key", "outcome"],
                                    registry=self.registry)
        self.key_tokens = Counter("specd_gateway_key_tokens", "completion tokens generated per API key (opaque label)",
                                  ["key"], registry=self.registry)
        self.key_store_errors = Counter("specd_gateway_key_store_errors",
                                        "key store (lookup) or rate limiter (limits) unreachable", ["op"],
                                        registry=self.registry)
        self._key_labels: set[str] = set()
        active_sessions(self.registry, "gateway", lambda: self.active)

    def key_label(self, name: str) -> str:
        """The `key` label of a key name: key_label(name) for the first MAX_KEY_LABELS names, then "other"."""
        if name in self._key_labels:
            return key_label(name)
        if len(self._key_labels) < MAX_KEY_LABELS:
            self._key_labels.add(name)
            return key_label(name)
        return OTHER_KEYS

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestCounter:
    """ASGI middleware counting each HTTP request once its status is known (a stream counts
    when its headers go out) and timing it until its last byte goes out (or, cut short, until
    it ends): a client that has its whole answer, and then scrapes /metrics, finds the request
    there. Pure ASGI, not BaseHTTPMiddleware, so that streaming responses and client
    disconnects pass through untouched."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        counted = timed = False
        start = time.perf_counter()

        def route() -> str:
            return getattr(scope.get("route"), "path", UNMATCHED)

        def count(status: int) -> None:
            nonlocal counted
            if not counted:
                counted = True
                self.metrics.requests.labels(route(), str(status)).inc()

        def time_it() -> None:
            nonlocal timed
            if not timed:
                timed = True
                self.metrics.duration.labels(route()).observe(time.perf_counter() - start)

        async def send_counting(message: Message) -> None:
            if message["type"] == "http.response.start":
                count(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                time_it()
            await send(message)

        self.metrics.active += 1
        try:
            await self.app(scope, receive, send_counting)
        except Exception:
            count(500)  # the outermost error middleware turns it into a 500
            raise
        finally:
            self.metrics.active -= 1
            time_it()
