"""The four real service processes (`specd serve target|draft|coordinator|gateway`) on
loopback with the embedded model, started once per test session and shared by the stack
and Prometheus tests; a target-only greedy reference decoded in-process."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.cli import free_port
from specd.engine import SpeculativeEngine
from specd.types import SamplingParams, SpecParams

QUESTION = "Explain in simple terms how a hash map works."
MESSAGES = [{"role": "user", "content": QUESTION}]
STARTUP_TIMEOUT_S = 600.0  # a target that compiles its CPU forward (about 3 minutes) beside other tests
HTTP_TIMEOUT_S = 120.0
MAX_TOKENS = 64  # the longest request; the reference is decoded once, this long
REPO_ROOT = Path(__file__).resolve().parents[2]


def _grpc_healthy(port: int) -> bool:
    from services.common.server import check_health

    return asyncio.run(check_health(f"127.0.0.1:{port}"))


def _http_healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class Stack:
    """The four processes; `procs` by service name, the draft's handle replaceable."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.ports = {name: free_port() for name in ("target", "draft", "coordinator", "gateway")}
        # /metrics of each process; the gateway serves it on its own port.
        self.metrics_ports = {name: free_port() for name in ("target", "draft", "coordinator")}
        self.metrics_ports["gateway"] = self.ports["gateway"]
        self.procs: dict[str, subprocess.Popen] = {}
        metrics = {name: ["--metrics-port", str(self.metrics_ports[name])] for name in ("target", "draft", "coordinator")}
        self.flags = {
            "target": ["--model", "embedded", "--threads", "1", *metrics["target"]],
            "draft": ["--drafter", "ngram", *metrics["draft"]],
            "coordinator": ["--target-address", self.address("target"),
                            "--draft-address", self.address("draft"), "--overlap", "true",
                            "--default-policy", "heuristic", *metrics["coordinator"]],
            "gateway": ["--coordinator-address", self.address("coordinator"), "--auth", "open"],  # loopback
        }
        self.starts = dict.fromkeys(self.ports, 0)

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['gateway']}"

    def metrics_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.metrics_ports[name]}/metrics"

    @property
    def draft(self) -> subprocess.Popen:
        return self.procs["draft"]

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}-{self.starts[name]}.log"

    def start(self, name: str) -> None:
        self.starts[name] += 1
        argv = [sys.executable, "-m", "specd", "serve", name, "--port", str(self.ports[name]), *self.flags[name]]
        with open(self.log_path(name), "w") as log:  # the child keeps its own descriptor
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                                start_new_session=True)

    def tail(self, name: str, chars: int = 3000) -> str:
        try:
            return self.log_path(name).read_text(errors="replace")[-chars:]
        except OSError as e:
            return f"(no log: {e})"

    def wait_healthy(self, name: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        probe = _http_healthy if name == "gateway" else _grpc_healthy
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            proc = self.procs[name]
            if proc.poll() is not None:
                pytest.fail(f"{name} exited with status {proc.returncode} before passing its health check; "
                            f"log {self.log_path(name)}:\n{self.tail(name)}", pytrace=False)
            if probe(self.ports[name]):
                return
            time.sleep(0.25)
        pytest.fail(f"{name} did not pass its health check within {timeout_s:.0f} s; "
                    f"log {self.log_path(name)}:\n{self.tail(name)}", pytrace=False)

    def stop(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def stop_all(self) -> None:
        for name in ("gateway", "coordinator", "draft", "target"):
            self.stop(name)


@pytest.fixture(scope="session")
def reference(embedded):
    """Target-only greedy decoding in-process: n -> (token ids, text) of the first n tokens.
    One decoding of MAX_TOKENS serves every n: greedy decoding of n tokens is the first n
    tokens of a longer greedy decoding (or all of it, when it stopped at EOS earlier)."""
    prompt = embedded.encode_prompt(QUESTION, chat=True)
    ids = SpeculativeEngine(embedded).generate(prompt, SamplingParams(max_new_tokens=MAX_TOKENS),
                                               SpecParams("none")).token_ids
    ids = list(ids)

    def run(n: int) -> tuple[list[int], str]:
        assert n <= MAX_TOKENS
        return ids[:n], embedded.decode(ids[:n])

    return run


@pytest.fixture(scope="session")
def stack(tmp_path_factory, request):
    s = Stack(tmp_path_factory.mktemp("stack-logs"))
    try:
        s.start("target")  # loads the model: start it first, the draft meanwhile
        s.start("draft")
        request.getfixturevalue("reference")  # decode the reference while the target loads
        s.wait_healthy("draft")
        s.wait_healthy("target")
        s.start("coordinator")  # connects to the target (and describes the draft) at start-up
        s.wait_healthy("coordinator")
        s.start("gateway")
        s.wait_healthy("gateway")
        yield s
    finally:
        s.stop_all()


