"""services.gateway.metrics.RequestCounter: each HTTP request is counted once, with its status,
and timed once, by the time its last byte goes out: a client that has its whole answer and
then scrapes /metrics finds it there (test_stack's scrape raced the app's wind-down)."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.metrics import UNMATCHED, GatewayMetrics, RequestCounter


def _timed(metrics: GatewayMetrics) -> float:
    return metrics.registry.get_sample_value("specd_gateway_request_duration_seconds_count",
                                             {"route": UNMATCHED}) or 0.0


def _counted(metrics: GatewayMetrics, status: str) -> float:
    return metrics.registry.get_sample_value("specd_gateway_requests_total",
                                             {"route": UNMATCHED, "status": status}) or 0.0


async def _receive() -> dict:
    return {"type": "http.request", "body": b"", "more_body": False}


def _serve(metrics: GatewayMetrics, app) -> list[tuple[float, float]]:
    """Run one request through the middleware: (timed, counted 200) as each body message is sent."""
    seen: list[tuple[float, float]] = []

    async def send(message) -> None:
        if message["type"] == "http.response.body":
            seen.append((_timed(metrics), _counted(metrics, "200")))

    asyncio.run(RequestCounter(app, metrics)({"type": "http", "path": "/x"}, _receive, send))
    return seen


def test_a_streamed_answer_is_counted_at_its_headers_and_timed_by_its_last_byte():
    metrics = GatewayMetrics()

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        await send({"type": "http.response.body", "body": b"b", "more_body": False})
        await asyncio.sleep(0.05)  # the app's wind-down, after the client has its answer

    assert _serve(metrics, app) == [(0.0, 1.0), (1.0, 1.0)]
    assert _timed(metrics) == 1.0 and _counted(metrics, "200") == 1.0


def test_a_request_cut_short_or_failing_is_timed_once_when_it_ends():
    metrics = GatewayMetrics()

    async def gone(scope, receive, send):  # the client left mid-stream: no last body message
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})

    async def broken(scope, receive, send):
        raise RuntimeError("boom")

    _serve(metrics, gone)
    assert _timed(metrics) == 1.0
    with pytest.raises(RuntimeError):
        _serve(metrics, broken)
    assert _timed(metrics) == 2.0 and _counted(metrics, "500") == 1.0 and metrics.active == 0
