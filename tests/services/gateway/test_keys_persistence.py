"""API keys survive a restart of the Redis the deployment runs (deploy/k8s/redis.yaml, compose),
and filling that Redis with TTL'd state evicts the state, never a key."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis
import yaml

from services.common.state import RedisStateStore
from services.gateway.keys import KeyRing, Limits, RedisKeyStore
from specd.state import StateKey
from tests.conftest import answers_ping

ROOT = Path(__file__).resolve().parents[3]
PASSWORD = "test-password"
pytestmark = pytest.mark.external  # starts redis-server processes of its own


def manifest_args() -> list[str]:
    """The redis container's args in deploy/k8s/redis.yaml, the password env var filled in."""
    for doc in yaml.safe_load_all((ROOT / "deploy/k8s/redis.yaml").read_text()):
        if doc and doc.get("kind") == "Deployment":
            (c,) = doc["spec"]["template"]["spec"]["containers"]
            return [PASSWORD if a == "$(REDISCLI_AUTH)" else a for a in c["args"]]
    raise AssertionError("no Deployment in deploy/k8s/redis.yaml")


def compose_args() -> list[str]:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    command = doc["services"]["redis"]["command"]
    assert command[0] == "redis-server"
    return [PASSWORD if a.startswith("${SPECD_REDIS_PASSWORD") else a for a in command[1:]]


class Server:
    """redis-server with `args`, its --dir replaced by a temporary directory (kept on restart)."""

    def __init__(self, args: list[str], data: Path, overrides: dict[str, str] | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not on PATH", pytrace=False)
        args = list(args)
        for flag, value in {"--dir": str(data), **(overrides or {})}.items():
            if flag in args:
                args[args.index(flag) + 1] = value
            else:
                args += [flag, value]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.argv = [binary, *args, "--port", str(self.port), "--bind", "127.0.0.1", "--daemonize", "no"]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://:{PASSWORD}@127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, password=PASSWORD, socket_timeout=1, socket_connect_timeout=1)
        if answers_ping(self.proc, client):
            return
        pytest.fail(f"redis-server {self.argv} did not start", pytrace=False)

    def stop(self) -> None:
        """SIGTERM, as Kubernetes and compose stop a container."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        """SIGKILL, as the OOM killer ends a container: no shutdown save."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


async def _identify(url: str, key: str):
    ring = KeyRing(RedisKeyStore(url))
    try:
        return await ring.identify(key)
    finally:
        await ring.close()


async def _create(url: str, name: str) -> str:
    store = RedisKeyStore(url)
    try:
        return await store.create(name, Limits(requests_per_minute=60))
    finally:
        await store.close()


@pytest.mark.parametrize("args", [manifest_args, compose_args], ids=["k8s", "compose"])
@pytest.mark.parametrize("how", ["stop", "kill"])
def test_keys_survive_a_restart_with_the_deployments_redis_flags(tmp_path, args, how):
    server = Server(args(), tmp_path)
    server.start()
    try:
        key = asyncio.run(_create(server.url, "customer"))
        assert asyncio.run(_identify(server.url, key)).name == "customer"
        if how == "kill":  # everysec may lose the last second of writes: rewrite the file first
            with redis.Redis.from_url(server.url) as c:
                c.execute_command("BGREWRITEAOF")

                def busy() -> bool:
                    info = c.info("persistence")
                    return bool(info["aof_rewrite_in_progress"] or info["aof_rewrite_scheduled"])

                deadline = time.monotonic() + 10
                while busy() and time.monotonic() < deadline:
                    time.sleep(0.05)
        getattr(server, how)()
        server.start()
        record = asyncio.run(_identify(server.url, key))
        assert record is not None and record.name == "customer"
        assert record.limits.requests_per_minute == 60
    finally:
        server.stop()


def test_api_keys_have_no_ttl_and_policy_state_always_has_one(redis_url):
    key = asyncio.run(_create(redis_url, "customer"))
    assert key
    state = RedisStateStore(redis_url)

    async def save():
        await state.save(StateKey("d", "t", "p", "tag"), {"k": 3.0})
        await state.close()

    asyncio.run(save())
    with redis.Redis.from_url(redis_url) as c:
        ttls = {k.decode(): c.ttl(k) for k in c.scan_iter("*")}
    keys = {k: t for k, t in ttls.items() if ":api-key" in k}
    assert set(keys) == {"specd:v1:api-keys", "specd:v1:api-key-names"}
    assert all(t == -1 for t in keys.values())  # no TTL: volatile-lru never evicts them
    assert all(t > 0 for k, t in ttls.items() if k not in keys)


def test_a_full_redis_evicts_policy_state_never_a_key(tmp_path):
    """The manifest's eviction policy with a small maxmemory: the state written past it is
    evicted, every key still authenticates."""
    server = Server(manifest_args(), tmp_path, {"--maxmemory": "2mb"})
    server.start()
    try:
        keys = [asyncio.run(_create(server.url, f"customer-{i}")) for i in range(20)]

        async def flood():
            store = RedisStateStore(server.url)
            blob = {f"f{j}": float(j) for j in range(40)}
            for i in range(6000):
                await store.save(StateKey("d", "t", "p", f"tag-{i}"), blob)
            await store.close()

        asyncio.run(flood())
        with redis.Redis.from_url(server.url) as c:
            assert c.info("stats")["evicted_keys"] > 0  # the flood did not fit
            assert c.dbsize() < 6000 + 2
        for key in keys:
            assert asyncio.run(_identify(server.url, key)) is not None
    finally:
        server.stop()
