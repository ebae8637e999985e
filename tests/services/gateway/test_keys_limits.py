"""Tokens per minute settle what a generation really cost: its prompt and completion tokens,
and for a stream cut before its finish chunk, the tokens it streamed."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import redis

from services.gateway import create_app
from services.gateway.keys import KeyRing, Limits, RedisKeyStore
from services.gateway.limits import RedisLimiter, settle

CHAT = "/v1/chat/completions"


def test_settle():
    assert settle(100, 10, 30) == 60  # prompt and completion are both charged
    assert settle(100, 90, 50) == -40  # more than the admission charge: debited
    assert settle(100, None, 0, 250) == -150  # a cut stream: what it streamed
    assert settle(100, None) == 0  # nothing seen: the admission charge stands


@pytest.fixture
def keyed(serve, local_backend, redis_url):
    """(base URL, bearer headers, bucket level()) of a gateway with a key of `tpm` tokens a minute."""

    def make(tpm: int):
        name = f"tpm-{tpm}"
        key = asyncio.run(RedisKeyStore(redis_url).create(name, Limits(tokens_per_minute=tpm)))
        url = serve(create_app(local_backend, keys=KeyRing(RedisKeyStore(redis_url)), limiter=RedisLimiter(redis_url)))
        bucket = RedisLimiter(redis_url).keys(name)[0]

        def level() -> float | None:
            with redis.Redis.from_url(redis_url) as c:
                raw = c.hget(bucket, "tok")
            return None if raw is None else float(raw)

        return url, {"Authorization": f"Bearer {key}"}, level

    return make


def _settled(level, below: float) -> float:
    """The bucket's level once the release (a background task after the response) lowered it under `below`."""
    deadline = time.monotonic() + 10
    while (value := level()) is None or value >= below:
        if time.monotonic() > deadline:
            return value
        time.sleep(0.02)
    return value


def test_prompt_tokens_count_in_tokens_per_minute(keyed):
    url, auth, level = keyed(1000)
    prompt = "tell me a story about the sea " * 10
    r = httpx.post(url + CHAT, headers=auth, timeout=30, json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] > 100
    # Refilled at 1000/60 a second between admission and release: far less than the prompt.
    value = _settled(level, 1000 - usage["prompt_tokens"] / 2)
    assert value <= 1000 - usage["total_tokens"] + 50, (value, usage)


def test_a_cut_stream_is_debited_what_it_streamed(keyed):
    """max_tokens 4x the minute's tokens: admission charges one minute (the cap); the client
    leaves after 40 characters (tokens) of it, so the key must pay at least those."""
    url, auth, level = keyed(20)
    chunks = 0
    with httpx.stream("POST", url + CHAT, headers=auth, timeout=30, json={
            "messages": [{"role": "user", "content": "Count"}], "max_tokens": 80, "temperature": 0,
            "stream": True}) as r:  # the tiny target's answer to "Count" runs past 40 tokens
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            chunks += len(delta.get("content") or "")  # the tiny pair's tokenizer: one token a character
            if chunks >= 40:
                break  # the client cuts the stream: no finish chunk was read
    assert chunks >= 40, "the stream ended before it could be cut"
    # Charged 20 at admission; 40 streamed tokens or more: at least 20 below zero, less the refill.
    value = _settled(level, -10)
    assert value is not None and value < -10, value
