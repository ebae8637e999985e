"""API keys as identities: `specd keys` over a keys file and over Redis, two gateways sharing
one Redis refusing a revoked key within a second, a wrong key refused before the body is
read, and a gateway that will not start with auth required and no key."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import time

import httpx
import pytest
import redis

from services.gateway import create_app
from services.gateway.keys import KEY_PREFIX, FileKeyStore, KeyRing, Limits, RedisKeyStore, digest
from specd.errors import Unavailable

CHAT = "/v1/chat/completions"
HI = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


def _create(specd_cli, name: str, *store: str, limits=()) -> str:
    code, out, err = specd_cli(["keys", "create", name, *store, *limits])
    assert code == 0, err
    key = out.strip()
    assert key.startswith(KEY_PREFIX) and "\n" not in key and "only time" in err
    return key


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_keys_file_create_list_revoke_through_the_cli(specd_cli, tmp_path):
    path = tmp_path / "keys" / "api-keys.json"
    store = ["--keys-file", str(path)]
    alice = _create(specd_cli, "alice", *store, limits=["--rpm", "5", "--concurrent", "2"])
    bob = _create(specd_cli, "bob.2_x-y", *store)
    assert alice != bob
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    text = path.read_text()
    assert alice not in text and bob not in text and digest(alice) in text  # only digests are stored

    code, out, _ = specd_cli(["keys", "list", *store])
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split() == ["NAME", "CREATED", "(UTC)", "RPM", "TPM", "CONCURRENT"]
    assert [r.split()[0] for r in rows] == ["alice", "bob.2_x-y"]
    assert rows[0].split()[3:] == ["5", "-", "2"] and rows[1].split()[3:] == ["-", "-", "-"]
    assert alice not in out and digest(alice) not in out
    code, out, _ = specd_cli(["keys", "list", "--json", *store])
    first = json.loads(out.splitlines()[0])
    assert first["name"] == "alice" and first["limits"]["requests_per_minute"] == 5
    assert abs(first["created"] - time.time()) < 60

    for argv, message in ((["create", "alice"], "exists"), (["create", "no/slash"], "invalid key name"),
                          (["create", "x" * 65], "invalid key name"), (["revoke", "carol"], "no API key")):
        code, _, err = specd_cli(["keys", *argv, *store])
        assert code == 2 and message in err, err
    code, out, _ = specd_cli(["keys", "revoke", "alice", *store])
    assert code == 0 and "revoked" in out
    code, out, _ = specd_cli(["keys", "list", "--json", *store])
    assert [json.loads(line)["name"] for line in out.splitlines()] == ["bob.2_x-y"]


def test_keys_need_a_store(specd_cli, monkeypatch, tmp_path):
    monkeypatch.delenv("SPECD_REDIS_URL", raising=False)
    monkeypatch.delenv("SPECD_GATEWAY_KEYS_FILE", raising=False)
    code, _, err = specd_cli(["keys", "list"])
    assert code == 2 and "--redis-url" in err and "--keys-file" in err
    monkeypatch.setenv("SPECD_GATEWAY_KEYS_FILE", str(tmp_path / "k.json"))  # the gateway's own variable
    _create(specd_cli, "from-env")
    assert "from-env" in (tmp_path / "k.json").read_text()


def test_redis_layout(specd_cli, redis_url):
    key = _create(specd_cli, "ops", "--redis-url", redis_url, limits=["--tpm", "1000"])
    with redis.Redis.from_url(redis_url, decode_responses=True) as r:
        stored = r.hgetall("specd:v1:api-keys")
        assert list(stored) == [digest(key)]
        assert json.loads(stored[digest(key)])["limits"]["tokens_per_minute"] == 1000
        assert r.hgetall("specd:v1:api-key-names") == {"ops": digest(key)}
        assert key not in json.dumps(stored)
    code, _, err = specd_cli(["keys", "create", "ops", "--redis-url", redis_url])
    assert code == 2 and "exists" in err
    code, out, _ = specd_cli(["keys", "list", "--redis-url", redis_url])
    assert "ops" in out and key not in out
    assert specd_cli(["keys", "revoke", "ops", "--redis-url", redis_url])[0] == 0
    with redis.Redis.from_url(redis_url) as r:
        assert r.hlen("specd:v1:api-keys") == 0 and r.hlen("specd:v1:api-key-names") == 0


@pytest.fixture(scope="module")
def gateways(serve, local_backend, redis_server):
    """Two gateways sharing the session's Redis for their keys."""
    return [serve(create_app(local_backend, keys=KeyRing(RedisKeyStore(redis_server.url)))) for _ in range(2)]


def test_a_revoked_key_is_refused_by_every_gateway_within_a_second(gateways, specd_cli, redis_server):
    store = ["--redis-url", redis_server.url]
    key = _create(specd_cli, "revoke-me", *store)
    for url in gateways:
        r = httpx.post(url + CHAT, json=HI, headers=_bearer(key), timeout=30)
        assert r.status_code == 200, r.text
        assert httpx.get(url + "/v1/models", headers=_bearer(key)).status_code == 200
    assert specd_cli(["keys", "revoke", "revoke-me", *store])[0] == 0
    revoked, refused = time.monotonic(), set()
    while len(refused) < len(gateways) and time.monotonic() - revoked < 5:
        for url in set(gateways) - refused:
            if httpx.get(url + "/v1/models", headers=_bearer(key)).status_code == 401:
                refused.add(url)
        time.sleep(0.02)
    assert len(refused) == len(gateways) and time.monotonic() - revoked < 1.0


def test_a_missing_or_unknown_key_is_a_401(gateways):
    url = gateways[0]
    for headers in ({}, _bearer("sk-specd-unknown"), {"Authorization": "Basic dXNlcjpwYXNz"},
                    {"Authorization": "Bearer"}):
        r = httpx.post(url + CHAT, json=HI, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        error = r.json()["error"]
        assert error.keys() == {"message", "type", "param", "code"}
        assert (error["type"], error["param"]) == ("invalid_request_error", None)
        assert error["code"] == "invalid_api_key"
    assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/metrics").status_code == 200
    # A 401 is counted under its route, like any other status.
    text = httpx.get(url + "/metrics").text
    assert 'specd_gateway_requests_total{route="/v1/chat/completions",status="401"}' in text


def test_a_wrong_key_is_refused_before_the_body_is_read(gateways):
    url = gateways[0]
    r = httpx.post(url + CHAT, content=b"{not json", headers={"content-type": "application/json",
                                                                **_bearer("wrong")})
    assert r.status_code == 401  # not 400: the body was never parsed
    # A body announced as 1 MB of which nothing is sent: the answer comes without it.
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer wrong\r\nContent-Length: 1000000\r\n\r\n{\"messages\": [")
        head = s.recv(65536).decode()
    assert head.startswith("HTTP/1.1 401") and "www-authenticate: bearer" in head.lower()


def test_known_keys_survive_a_store_outage_and_unknown_ones_get_503(tmp_path):
    """The store unreadable: a key accepted within the grace period still is, any other is
    Unavailable (503, not 401: it may be valid)."""
    path = tmp_path / "keys.json"
    store = FileKeyStore(path)
    ring = KeyRing(store, static_keys=["legacy-1", "legacy-2"])

    async def scenario():
        key = await store.create("known", Limits())
        assert (await ring.identify(key)).name == "known"
        assert (await ring.identify("legacy-2")).name == "key-2"  # static keys: key-1, key-2, ...
        assert await ring.identify("nope") is None and await ring.count() == 3
        path.write_text("{broken")  # the store fails from now on
        await asyncio.sleep(0.6)  # past the cache's freshness
        assert (await ring.identify(key)).name == "known"
        assert (await ring.identify("legacy-1")).name == "key-1"
        with pytest.raises(Unavailable):
            await ring.identify("never-seen")
        assert await ring.identify("nope") is None  # said unknown just now (keys.NEGATIVE_TTL_S)

    asyncio.run(scenario())


def test_a_corrupt_key_record_is_a_503_not_a_500(serve, local_backend, redis_url):
    key = "sk-specd-corrupt"
    store = RedisKeyStore(redis_url)
    with redis.Redis.from_url(redis_url) as raw:
        raw.hset(store.keys_key, digest(key), "{not json")
    url = serve(create_app(local_backend, keys=KeyRing(store)))
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]},
                   headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"], r.text


def test_auth_required_without_a_key_refuses_to_start(specd_cli, tmp_path, redis_url, monkeypatch):
    monkeypatch.delenv("SPECD_REDIS_URL", raising=False)
    monkeypatch.delenv("SPECD_GATEWAY_API_KEYS", raising=False)
    empty = tmp_path / "none.json"
    for store, hint in ((["--keys-file", str(empty)], f"--keys-file {empty}"),
                        (["--redis-url", redis_url], f"--redis-url {redis_url}"),
                        ([], "--keys-file PATH")):
        code, _, err = specd_cli(["serve", "gateway", "--port", "0", *store])
        assert code == 2, err
        assert "no API key" in err and "specd keys create NAME" in err and hint in err
        assert "--auth open" in err
    code, _, err = specd_cli(["serve", "gateway", "--auth", "sometimes"])
    assert code == 2 and "auth" in err
