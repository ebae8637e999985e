"""Shared fixtures: tiny seeded random models for fast tests, the real embedded model once
per session (dequantized weights cached under SPECD_CACHE_DIR or ~/.cache/specd)."""

from __future__ import annotations

import pytest
import torch

from specd.runtime.tiny import loaded, perturbed, save_tiny, tiny_llama

torch.set_num_threads(2)

# Fixtures that start another program: their tests are not unit tests (`make test-fast` skips them).
EXTERNAL_FIXTURES = {"redis_server", "redis_url"}


def pytest_collection_modifyitems(config, items):
    """Markers from what a test uses, so that none is forgotten: `embedded` for every test of
    the real model, `external` for every test that starts another program (redis-server,
    prometheus, `specd serve` processes: tests/integration, the Redis fixtures)."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if "embedded" in names:
            item.add_marker(pytest.mark.embedded)
        if names & EXTERNAL_FIXTURES or "integration" in item.path.parts:
            item.add_marker(pytest.mark.external)


@pytest.fixture(scope="session")
def tiny_target():
    return loaded(tiny_llama(0, layers=4), "tiny-target")


@pytest.fixture(scope="session")
def tiny_draft(tiny_target):
    """A noisy copy of the target: agrees on many tokens, not all."""
    return loaded(perturbed(tiny_target.model, 0.01, seed=1), "tiny-draft")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, tiny_target, tiny_draft):
    """(target_dir, draft_dir): the tiny pair saved as transformers directories with a tokenizer."""
    root = tmp_path_factory.mktemp("tiny")
    return save_tiny(root / "target", model=tiny_target.model), save_tiny(root / "draft", model=tiny_draft.model)


@pytest.fixture(scope="session")
def embedded():
    from specd.runtime import load_model

    return load_model("embedded", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def hf_greedy():
    """transformers' own greedy decoding: the reference every speculative run must match."""
    cache: dict = {}

    def run(model: torch.nn.Module, prompt: list[int], n: int, eos: int | None = None) -> list[int]:
        key = (id(model), tuple(prompt), n, eos)
        if key not in cache:
            cache[key] = _hf_greedy(model, prompt, n, eos)
        return cache[key]

    return run


def _hf_greedy(model: torch.nn.Module, prompt: list[int], n: int, eos: int | None = None) -> list[int]:
    kwargs = {"eos_token_id": eos} if eos is not None else {"min_new_tokens": n}
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         pad_token_id=model.config.pad_token_id, **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.fixture
def specd_cli(capsys):
    """Run the `specd` command in-process: argv -> (exit code, stdout, stderr)."""
    from specd.cli import main

    def run(argv: list[str]) -> tuple[int, str, str]:
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's own errors
            code = e.code
        out, err = capsys.readouterr()
        return code, out, err

    return run


def answers_ping(proc, client, timeout_s: float = 10) -> bool:
    """Whether a redis-server just started as `proc` answers `client`'s PING before it exits or
    timeout_s passes; closes the client."""
    import time

    import redis

    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if client.ping():
                    return True
            except redis.exceptions.RedisError:
                time.sleep(0.05)
        return False
    finally:
        client.close()


class RedisServer:
    """A private redis-server on a free loopback port; its data lives under `dir`."""

    def __init__(self, binary: str, dir) -> None:
        self.binary, self.dir, self.port, self.proc = binary, dir, 0, None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, port: int | None = None) -> None:
        import socket
        import subprocess

        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        for _ in range(3):  # a free port can be taken between choosing it and binding it
            if port is None:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    self.port = s.getsockname()[1]
            else:
                self.port = port
            # --save "": no snapshots of its own; restart() saves explicitly before stopping.
            self.proc = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.dir), "--daemonize", "no"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            client = redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1,
                                 retry=Retry(NoBackoff(), 0))
            if answers_ping(self.proc, client):
                return
            self.stop()
        pytest.fail(f"redis-server did not answer PING on 127.0.0.1:{self.port}", pytrace=False)

    def restart(self) -> None:
        """Save a snapshot, stop the server, start it again on the same port with the same data."""
        import redis

        with redis.Redis(port=self.port) as client:
            client.save()
        self.stop()
        self.start(self.port)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A redis-server for this test session (Debian's package: `make test` installs it)."""
    import shutil

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not on PATH: install it with `sudo apt-get install -y redis-server` "
                    "(`make redis` or `make test` do it on Debian).", pytrace=False)
    server = RedisServer(binary, tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    """The session server's URL, its database flushed before the test."""
    import redis

    with redis.Redis.from_url(redis_server.url) as client:
        client.flushdb()
    return redis_server.url
