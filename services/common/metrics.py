"""Prometheus plumbing shared by every process (the core records plain
statistics; each service's `metrics` module turns them into series).

Each process exports its series from a registry of its own (several services can share one
Python process, as in the tests): the gateway on its HTTP port at /metrics, the draft,
target and coordinator services on their `metrics_port`. Every name starts with `specd_`;
counters are cumulative, so any rate over any window can be computed. The series are:

  process          series (labels)
  every gRPC one   specd_grpc_requests_total (service, method, code)
                   specd_grpc_request_duration_seconds (service, method)
                   specd_active_sessions (service)
  coordinator      services.coordinator.metrics (also in the gateway when it runs the
                   coordinator in-process): requests, tokens, verifications, fallbacks,
                   draft/accepted lengths, latencies, generation vs target-only seconds
  draft            services.draft.metrics: draft step latency, drafted tokens, windows, KV bytes
  target           services.target.metrics: verify latency by window, batch sizes, the
                   measured per-token decode cost, KV bytes
  gateway          services.gateway.metrics: HTTP requests and latency by route

`catalog()` lists every metric name the code exports; the dashboard test checks that the
shipped PromQL uses no other.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)

disable_created_metrics()  # no *_created series: a counter's start time is not worth a series each

# Seconds, from a sub-millisecond draft step to a long generation.
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256)  # sessions per forward
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TOKEN_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 64)
MAX_LABELLED_POSITION = 16  # draft positions past this share the label "17+" (bounded cardinality)
MAX_LABELLED_WINDOW = 16


def opaque_label(prefix: str, text: str) -> str:
    """A label value that names `text` without showing it (/metrics is open on the API port):
    `prefix` and 12 hex digits of its SHA-256, the same in every process."""
    return prefix + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]

def new_registry() -> CollectorRegistry:
    """A registry with the process collector (CPU seconds, resident memory, open fds)."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    return registry


def serve_metrics(registry: CollectorRegistry, host: str, port: int):
    """Serve /metrics of registry on host:port in a daemon thread; returns (server, bound port)."""
    server, _thread = start_http_server(port, host, registry)
    return server, server.server_port


def count_label(n: int, cap: int) -> str:
    """A bounded label for a count: "0".."cap", then "cap+1+"."""
    return str(n) if n <= cap else f"{cap + 1}+"


class RpcMetrics:
    """Calls per gRPC method and final status code, and their duration, recorded by the
    error interceptor (services.common.grpc_errors) when each call ends."""

    def __init__(self, registry: CollectorRegistry, service: str):
        self.service = service
        self.requests = Counter("specd_grpc_requests", "gRPC calls by method and final status code",
                                ["service", "method", "code"], registry=registry)
        self.duration = Histogram("specd_grpc_request_duration_seconds",
                                  "gRPC call duration (a streaming session: its whole life)",
                                  ["service", "method"], buckets=LATENCY_BUCKETS, registry=registry)

    def observe(self, method: str, code: str, seconds: float) -> None:
        name = method.rsplit("/", 1)[-1]
        self.requests.labels(self.service, name, code).inc()
        self.duration.labels(self.service, name).observe(seconds)


_per_service: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, Gauge]] = weakref.WeakKeyDictionary()


def _service_gauge(registry: CollectorRegistry, name: str, doc: str, service: str,
                   read: Callable[[], float]) -> Gauge:
    """One gauge family per registry, a child per service (a gateway running the coordinator
    in-process exports both of theirs), each read from its service at scrape time."""
    gauges = _per_service.setdefault(registry, {})
    if name not in gauges:
        gauges[name] = Gauge(name, doc, ["service"], registry=registry)
    gauges[name].labels(service).set_function(read)
    return gauges[name]


def active_sessions(registry: CollectorRegistry, service: str, read: Callable[[], int]) -> Gauge:
    """specd_active_sessions{service}: sessions (requests) in progress."""
    return _service_gauge(registry, "specd_active_sessions", "sessions (requests) in progress", service, read)


def kv_cache_bytes(registry: CollectorRegistry, service: str, read: Callable[[], int]) -> Gauge:
    """specd_kv_cache_bytes{service}: bytes held by the KV caches of open sessions."""
    return _service_gauge(registry, "specd_kv_cache_bytes", "bytes held by the KV caches of open sessions",
                          service, read)


def catalog() -> set[str]:
    """Every metric family name the processes export (histograms and counters by their base
    name, as Prometheus exposes them with _bucket/_sum/_count and _total)."""
    from services.coordinator.metrics import CoordinatorMetrics
    from services.draft.metrics import DraftMetrics
    from services.gateway.metrics import GatewayMetrics
    from services.target.metrics import TargetMetrics

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    names: set[str] = set()
    registries = [CoordinatorMetrics(new_registry()).registry, DraftMetrics(new_registry(), "-").registry,
                  TargetMetrics(new_registry(), "-").registry, GatewayMetrics().registry]
    for registry in registries:
        RpcMetrics(registry, "-")
        for family in registry.collect():
            names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
    return names
