"""Real `specd serve` processes (tiny transformers directories): a coordinator started before
its target waits for it (health NOT_SERVING, no exit) and serves once it is up; SIGTERM mid-
stream lets the stream complete, refuses new calls, and the process exits 0 without waiting out
its drain grace (600 s)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cli import free_port
from services.common.server import channel
from services.proto.specd.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.external  # real `specd serve` processes


def serve(name: str, log: Path, *flags: str) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "specd", "serve", name, "--metrics-port", "0", *flags],
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)


def status(address: str):
    async def check():
        async with channel(address) as ch:
            try:
                return (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)).status
            except grpc.aio.AioRpcError:
                return None

    return asyncio.run(check())


def wait(predicate, timeout_s: float, what: str, procs, logs) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        dead = [p for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            tails = "\n".join(f"--- {log.name} ---\n{log.read_text()[-2000:]}" for log in logs)
            raise AssertionError(f"{what} (exited: {[p.args[3] for p in dead]})\n{tails}")
        time.sleep(0.1)


def test_coordinator_waits_for_its_target_and_drains_on_sigterm(tiny_dirs, tmp_path):
    target_dir, _ = tiny_dirs
    tport, cport = free_port(), free_port()
    caddr = f"127.0.0.1:{cport}"
    logs = [tmp_path / "coordinator.log", tmp_path / "target.log"]
    coord = serve("coordinator", logs[0], "--port", str(cport), "--target-address", f"127.0.0.1:{tport}",
                  "--draft-address", "", "--default-policy", "constant")
    procs, target = [coord], None
    try:
        wait(lambda: status(caddr) == health_pb2.HealthCheckResponse.NOT_SERVING, 60, "coordinator NOT_SERVING",
             procs, logs)
        target = serve("target", logs[1], "--port", str(tport), "--model", str(target_dir), "--threads", "1")
        procs.append(target)
        wait(lambda: status(caddr) == health_pb2.HealthCheckResponse.SERVING, 120, "coordinator SERVING",
             procs, logs)
        assert "not reachable yet" in logs[0].read_text()  # retried, one line each

        async def stream_through_sigterm():
            async with channel(caddr) as ch:
                stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
                request = coordinator_pb2.GenerateRequest(prompt="hello", max_new_tokens=200,
                                                          speculative=coordinator_pb2.Speculative(policy="none"))
                call = stub.Generate(request, timeout=60)
                messages = [await call.read()]
                coord.send_signal(signal.SIGTERM)
                while (message := await call.read()) is not grpc.aio.EOF:
                    messages.append(message)
                return messages

        messages = asyncio.run(stream_through_sigterm())
        finish = messages[-1]
        assert finish.HasField("finish"), messages[-1]
        tokens = sum(len(m.tokens.ids) for m in messages if m.HasField("tokens"))
        assert tokens == finish.finish.completion_tokens > 0
        assert coord.wait(20) == 0  # exits once the stream is done: far from the 600 s grace
        assert status(caddr) is None  # nobody answers there any more
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
    assert target.returncode == 0
