"""Per-key limits shared by two gateways through one real Redis: requests and tokens per
minute (429, Retry-After, OpenAI's x-ratelimit-* headers), concurrent requests released when
a stream ends, leases of a crashed gateway expiring, limits failing open when Redis is down,
the same limits in memory without Redis, and the per-key usage series."""

from __future__ import annotations

import asyncio
import math
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from services.coordinator.api import FinishEvent, TokenEvent
from services.gateway import create_app
from services.gateway.keys import FileKeyStore, KeyRing, Limits, RedisKeyStore
from services.gateway.limits import MemoryLimiter, RedisLimiter, duration
from services.gateway.metrics import MAX_KEY_LABELS, GatewayMetrics, key_label

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]
RATE_HEADERS = {f"x-ratelimit-{what}-{kind}" for what in ("limit", "remaining", "reset")
                for kind in ("requests", "tokens")}


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _create(specd_cli, name: str, store: list[str], *limits: str) -> str:
    code, out, err = specd_cli(["keys", "create", name, *store, *limits])
    assert code == 0, err
    return out.strip()


def _chat(url: str, key: str, **body) -> httpx.Response:
    return httpx.post(url + CHAT, json={"messages": HI, "temperature": 0, "max_tokens": 2, **body},
                      headers=_bearer(key), timeout=30)


def _keyed_app(backend, url: str, **kwargs):
    return create_app(backend, keys=KeyRing(RedisKeyStore(url)), limiter=RedisLimiter(url, **kwargs))


@pytest.fixture(scope="module")
def gateways(serve, local_backend, redis_server):
    """Two gateways sharing the session's Redis for their keys and limits."""
    return [serve(_keyed_app(local_backend, redis_server.url)) for _ in range(2)]


@pytest.fixture(scope="module")
def store(redis_server):
    return ["--redis-url", redis_server.url]


def test_requests_per_minute_are_shared_by_the_gateways(gateways, specd_cli, store):
    key = _create(specd_cli, "rpm-4", store, "--rpm", "4")
    for i in range(4):  # A, B, A, B: one bucket
        r = _chat(gateways[i % 2], key)
        assert r.status_code == 200, r.text
        assert r.headers["x-ratelimit-limit-requests"] == "4"
        assert r.headers["x-ratelimit-remaining-requests"] == str(3 - i)
        assert r.headers["x-ratelimit-reset-requests"].endswith("s")
        assert "x-ratelimit-limit-tokens" not in r.headers  # the key has no token limit
    for url in gateways:
        r = _chat(url, key)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and r.json()["error"]["type"] == "requests"
        assert "requests per min" in r.json()["error"]["message"] and r.json()["error"]["param"] is None
        assert 1 <= int(r.headers["retry-after"]) <= 15  # one request refills in 60/4 s
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert r.headers["x-ratelimit-limit-requests"] == "4"
    text = httpx.get(gateways[0] + "/metrics").text
    label = key_label("rpm-4")  # the same on both gateways
    assert f'specd_gateway_key_requests_total{{key="{label}",outcome="admitted"}} 2.0' in text
    assert f'specd_gateway_key_requests_total{{key="{label}",outcome="rate_limited"}} 1.0' in text
    assert f'specd_gateway_key_tokens_total{{key="{label}"}} 4.0' in text  # two answers of max_tokens 2
    assert 'specd_gateway_requests_total{route="/v1/chat/completions",status="429"}' in text


def test_tokens_per_minute(gateways, specd_cli, store):
    key = _create(specd_cli, "tpm-100", store, "--tpm", "100")
    t0 = time.monotonic()
    # The tiny target writes all 60 tokens of its answer to "Count" (no EOS that soon).
    r = _chat(gateways[0], key, max_tokens=60, messages=[{"role": "user", "content": "Count"}])
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 60
    assert r.headers["x-ratelimit-limit-tokens"] == "100"
    assert r.headers["x-ratelimit-remaining-tokens"] == "40"
    assert "x-ratelimit-limit-requests" not in r.headers
    prompt = r.json()["usage"]["prompt_tokens"]  # settled when the answer ended: prompt + completion
    assert 0 < prompt < 40
    r = _chat(gateways[1], key, max_tokens=60)
    assert r.status_code == 429
    assert r.json()["error"]["type"] == "tokens" and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(r.headers["retry-after"]) <= math.ceil((20 + prompt) * 0.6) + 1  # 20 + prompt tokens at 100/min
    # the bucket refills continuously: a token each 0.6 s since the first charge (a slow machine)
    left = 40 - prompt
    assert left <= int(r.headers["x-ratelimit-remaining-tokens"]) <= left + (time.monotonic() - t0) * 100 / 60
    assert _chat(gateways[1], key, max_tokens=left).status_code == 200  # fits in what is left
    # A stream is charged too: its max_tokens (the default 256 when unset) is capped at the
    # bucket's capacity, so it waits for a full bucket.
    r = httpx.post(gateways[0] + CHAT, json={"messages": HI, "stream": True}, headers=_bearer(key))
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1


def test_refund_of_unused_tokens(redis_url):
    limits = Limits(tokens_per_minute=1000)

    async def scenario():
        limiter = RedisLimiter(redis_url)
        try:
            first = await limiter.acquire("refund", limits, 600, "a")
            assert first.allowed and first.charged == 600 and first.remaining_tokens == 400
            assert not (await limiter.acquire("refund", limits, 600, "b")).allowed
            await limiter.release("refund", limits, "a", 590)  # used 10 of 600
            again = await limiter.acquire("refund", limits, 600, "c")
            assert again.allowed and 390 <= again.remaining_tokens <= 400
        finally:
            await limiter.close()

    asyncio.run(scenario())


class _Held:
    """A backend whose answers wait until `go` is set (generation is not under test here: how
    long a request holds its key's slot is)."""

    def __init__(self, card):
        self.card, self.go = card, threading.Event()

    def model_card(self):
        return self.card

    async def ready(self) -> bool:
        return True

    async def generate(self, request):
        yield TokenEvent([1], "Hi")
        while not self.go.is_set():
            await asyncio.sleep(0.01)
        yield FinishEvent("stop", 1, 1)


def test_concurrent_requests_are_released_when_the_stream_ends(serve, local_backend, specd_cli, redis_url):
    backend = _Held(local_backend.model_card())
    urls = [serve(_keyed_app(backend, redis_url)) for _ in range(2)]
    key = _create(specd_cli, "one-at-a-time", ["--redis-url", redis_url], "--concurrent", "1")

    started = threading.Event()

    def stream():
        with httpx.stream("POST", urls[0] + CHAT, json={"messages": HI, "stream": True}, headers=_bearer(key),
                          timeout=30) as r:
            lines = r.iter_lines()
            head = next(lines)
            started.set()  # the stream holds the key's one slot until it ends
            return r.status_code, "\n".join([head, *lines])

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(stream)
        assert started.wait(10)
        refused = _chat(urls[1], key)
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "requests"
        assert "concurrent" in refused.json()["error"]["message"] and refused.headers["retry-after"] == "1"
        assert _chat(urls[0], key).status_code == 429  # on the stream's own gateway too
        backend.go.set()
        status, body = first.result(10)
    assert status == 200 and "[DONE]" in body
    deadline = time.monotonic() + 5
    while (r := _chat(urls[1], key)).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert r.status_code == 200, r.text


def test_a_crashed_gateways_leases_expire_and_live_ones_are_renewed(redis_url):
    limits = Limits(concurrent_requests=1)

    async def scenario():
        crashed, live, other = (RedisLimiter(redis_url, lease_ttl_s=0.3) for _ in range(3))
        try:
            assert (await crashed.acquire("lease", limits, 0, "x")).allowed
            await crashed.close()  # gone without releasing: its renewals stop
            assert not (await other.acquire("lease", limits, 0, "y")).allowed
            await asyncio.sleep(0.4)
            assert (await live.acquire("lease", limits, 0, "z")).allowed  # x expired
            await asyncio.sleep(0.6)  # twice the TTL: z is renewed by its gateway
            assert not (await other.acquire("lease", limits, 0, "y")).allowed
            await live.release("lease", limits, "z", 0)
            assert (await other.acquire("lease", limits, 0, "y")).allowed
        finally:
            await live.close()
            await other.close()

    asyncio.run(scenario())


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_limits_fail_open_when_redis_is_down(serve, local_backend, specd_cli, tmp_path):
    keys_file = tmp_path / "keys.json"
    key = _create(specd_cli, "no-redis", ["--keys-file", str(keys_file)], "--rpm", "1")
    down = RedisLimiter(f"redis://127.0.0.1:{_closed_port()}/0")
    url = serve(create_app(local_backend, keys=KeyRing(FileKeyStore(keys_file)), limiter=down))
    t0 = time.monotonic()
    assert [_chat(url, key).status_code for _ in range(3)] == [200, 200, 200]  # over rpm 1: not enforced
    assert time.monotonic() - t0 < 10  # no request hangs on the unreachable Redis
    text = httpx.get(url + "/metrics").text
    assert 'specd_gateway_key_store_errors_total{op="limits"}' in text
    label = key_label("no-redis")
    assert f'specd_gateway_key_requests_total{{key="{label}",outcome="admitted"}} 3.0' in text


def test_limits_fail_open_when_redis_refuses_writes(serve, local_backend, specd_cli, tmp_path, redis_url):
    """An OOM (or READONLY) reply is an error of Redis, not of the request: the limits fail open
    as they do for an unreachable Redis, never a 500."""
    import redis

    keys_file = tmp_path / "keys.json"
    key = _create(specd_cli, "oom", ["--keys-file", str(keys_file)], "--rpm", "1")
    url = serve(create_app(local_backend, keys=KeyRing(FileKeyStore(keys_file)), limiter=RedisLimiter(redis_url)))
    with redis.Redis.from_url(redis_url) as raw:
        raw.set("ballast", "x" * 1000)  # the script's writes then exceed maxmemory
        raw.config_set("maxmemory", "1")
        try:
            assert [_chat(url, key).status_code for _ in range(2)] == [200, 200]  # over rpm 1: not enforced
        finally:
            raw.config_set("maxmemory", "0")
    assert 'specd_gateway_key_store_errors_total{op="limits"}' in httpx.get(url + "/metrics").text


def test_without_redis_the_limits_hold_in_memory(serve, local_backend, specd_cli, tmp_path):
    keys_file = tmp_path / "keys.json"
    key = _create(specd_cli, "memory", ["--keys-file", str(keys_file)], "--rpm", "2", "--tpm", "50")
    url = serve(create_app(local_backend, keys=KeyRing(FileKeyStore(keys_file)), limiter=MemoryLimiter()))
    first = _chat(url, key, max_tokens=10)
    assert first.status_code == 200 and RATE_HEADERS <= first.headers.keys()
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert first.headers["x-ratelimit-remaining-tokens"] == "40"
    assert _chat(url, key, max_tokens=45).json()["error"]["type"] == "tokens"
    assert _chat(url, key, max_tokens=10).status_code == 200
    r = _chat(url, key, max_tokens=10)
    assert r.status_code == 429 and r.json()["error"]["type"] == "requests"
    assert 1 <= int(r.headers["retry-after"]) <= 30


def test_key_labels_are_bounded():
    metrics = GatewayMetrics()
    labels = [metrics.key_label(f"k{i}") for i in range(MAX_KEY_LABELS + 5)]
    assert labels[:MAX_KEY_LABELS] == [key_label(f"k{i}") for i in range(MAX_KEY_LABELS)]
    assert len(set(labels[:MAX_KEY_LABELS])) == MAX_KEY_LABELS
    assert set(labels[MAX_KEY_LABELS:]) == {"other"} and metrics.key_label("k0") == key_label("k0")


def test_metrics_show_no_key_name(serve, local_backend, specd_cli, tmp_path):
    """/metrics is open on the API port: per-key usage is there under opaque labels only."""
    keys_file = tmp_path / "keys.json"
    names = ["acme-corp-prod", "globex-billing"]
    keys = [_create(specd_cli, name, ["--keys-file", str(keys_file)], "--rpm", "1") for name in names]
    url = serve(create_app(local_backend, keys=KeyRing(FileKeyStore(keys_file)), limiter=MemoryLimiter()))
    for key in keys:
        assert _chat(url, key).status_code == 200
        assert _chat(url, key).status_code == 429
    text = httpx.get(url + "/metrics").text
    for name in names:
        assert name not in text
        assert f'specd_gateway_key_requests_total{{key="{key_label(name)}",outcome="rate_limited"}} 1.0' in text
        assert f'specd_gateway_key_tokens_total{{key="{key_label(name)}"}} 2.0' in text


def test_reset_durations_are_written_as_openai_does():
    assert [duration(ms) for ms in (0, 20, 999, 1000, 1500, 59_999, 60_000, 61_250)] == \
        ["0ms", "20ms", "999ms", "1s", "1.5s", "59.999s", "1m0s", "1m1.25s"]
