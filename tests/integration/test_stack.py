"""The four real service processes (`specd serve target|draft|coordinator|gateway`) on
loopback, driven over HTTP like a user would: greedy answers through gateway -> coordinator
-> draft/target equal the embedded model's own target-only decoding, a draft service killed
mid-stream falls back to the target without changing the answer (and is used again once
restarted on the same port), and the openai SDK parses the gateway's stream."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from specd.engine import SpeculativeEngine
from specd.types import SamplingParams, SpecParams

pytestmark = pytest.mark.embedded

QUESTION = "Explain in simple terms how a hash map works."
MESSAGES = [{"role": "user", "content": QUESTION}]
STARTUP_TIMEOUT_S = 300.0
HTTP_TIMEOUT_S = 120.0
MAX_TOKENS = 64  # the longest request; the reference is decoded once, this long
REPO_ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        self.ports = {name: _free_port() for name in ("target", "draft", "coordinator", "gateway")}
        self.procs: dict[str, subprocess.Popen] = {}
        self.flags = {
            "target": ["--model", "embedded", "--threads", "1"],
            "draft": ["--drafter", "ngram"],
            "coordinator": ["--target-address", self.address("target"),
                            "--draft-address", self.address("draft"), "--overlap", "true",
                            "--default-policy", "heuristic"],
            "gateway": ["--coordinator-address", self.address("coordinator")],
        }
        self.starts = dict.fromkeys(self.ports, 0)

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['gateway']}"

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


@pytest.fixture(scope="module")
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


@pytest.fixture(scope="module")
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


def _chat(stack: Stack, max_tokens: int, **speculative) -> dict:
    body = {"model": "specd", "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0}
    if speculative:
        body["speculative"] = speculative
    reply = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=HTTP_TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _fail_with_logs(stack: Stack, message: str) -> None:
    logs = "\n".join(f"--- {n} ---\n{stack.tail(n, 1500)}" for n in ("coordinator", "draft", "gateway"))
    pytest.fail(f"{message}\n{logs}", pytrace=False)


# -- 1. lossless through the real processes ---------------------------------------------------

def test_greedy_through_the_stack_equals_target_only_decoding(stack, reference):
    n = 32
    want_ids, want_text = reference(n)
    assert want_text.strip()
    for policy in ("heuristic", "constant"):
        for overlap in (True, False):
            doc = _chat(stack, n, policy=policy, overlap=overlap)
            stats, case = doc["spec_stats"], f"policy {policy}, overlap {overlap}"
            if stats["fallback"]:
                _fail_with_logs(stack, f"{case}: fell back to the target alone: {stats['fallback_reason']}")
            assert doc["choices"][0]["message"]["content"] == want_text, case
            assert stats["overlap"] is overlap, case
            assert stats["policy"] == policy, case
            assert stats["drafter"].startswith("ngram"), case
            assert doc["usage"]["completion_tokens"] == len(want_ids) == stats["new_tokens"], case
            assert doc["choices"][0]["finish_reason"] == ("length" if len(want_ids) == n else "stop"), case
            assert 1 <= stats["verifications"] <= len(want_ids), case
            assert 0 <= stats["accepted"] <= stats["drafted"], case
            if doc["choices"][0]["finish_reason"] == "length":  # (an EOS may cut an accepted run short)
                assert stats["verifications"] + stats["accepted"] == len(want_ids), case  # each: accepted + 1

    plain = _chat(stack, n, enabled=False)
    assert plain["choices"][0]["message"]["content"] == want_text
    assert plain["spec_stats"]["policy"] == "none"
    assert plain["spec_stats"]["drafted"] == 0
    assert plain["spec_stats"]["verifications"] == len(want_ids)


# -- 2. the draft service dies mid-stream -----------------------------------------------------

def _stream_killing_draft(stack: Stack, max_tokens: int) -> tuple[str, dict | None, bool]:
    """Stream one greedy answer, SIGKILLing the draft after the first content chunk:
    (text, spec_stats of the final chunk before [DONE], whether [DONE] arrived)."""
    body = {"model": "specd", "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "speculative": {"policy": "heuristic"}}
    parts, last, done, killed = [], {}, False, False
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body, timeout=HTTP_TIMEOUT_S) as reply:
        assert reply.status_code == 200, reply.read().decode()
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                done = True
                break
            chunk = json.loads(payload)
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                content = choice["delta"].get("content")
                if content:
                    parts.append(content)
                    if not killed:
                        os.kill(stack.draft.pid, signal.SIGKILL)
                        stack.draft.wait(10)
                        killed = True
            last = chunk
    assert killed, "no content chunk arrived"
    return "".join(parts), last.get("spec_stats"), done


def test_draft_killed_mid_stream_falls_back_then_is_used_again(stack, reference):
    n = MAX_TOKENS
    want_ids, want_text = reference(n)
    text, stats, done = _stream_killing_draft(stack, n)
    assert done, "the stream did not end with [DONE]"
    assert stats is not None, "the final chunk carried no spec_stats"
    assert text == want_text
    assert stats["new_tokens"] == len(want_ids)
    if not stats["fallback"]:
        _fail_with_logs(stack, f"the draft was killed mid-stream but spec_stats says no fallback: {stats}")
    assert stats["fallback_reason"], stats
    assert "draft" in stats["fallback_reason"].lower(), stats["fallback_reason"]

    # While the draft is down, requests are still answered by the target alone.
    down = _chat(stack, 8, policy="heuristic")
    assert down["spec_stats"]["fallback"] is True
    assert down["choices"][0]["message"]["content"] == reference(8)[1]

    # The same port again: a new request speculates again. The coordinator's channel to the
    # draft may still be in its reconnect backoff (at most 2 s) for the first one or two.
    stack.start("draft")
    stack.wait_healthy("draft", timeout_s=60)
    reasons, deadline = [], time.monotonic() + 15
    while True:
        doc = _chat(stack, 16, policy="heuristic")
        stats = doc["spec_stats"]
        if not stats["fallback"]:
            break
        reasons.append(stats["fallback_reason"])
        if time.monotonic() > deadline:
            _fail_with_logs(stack, f"the restarted draft was not used by {len(reasons)} requests: {reasons}")
        time.sleep(0.5)
    assert doc["choices"][0]["message"]["content"] == reference(16)[1]
    assert stats["drafter"].startswith("ngram")
    assert stack.draft.poll() is None


# -- 3. the openai SDK over the real stream ---------------------------------------------------

def test_openai_sdk_streams_with_spec_stats(stack, reference):
    from openai import OpenAI

    n = 24
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="x", timeout=HTTP_TIMEOUT_S, max_retries=0)
    stream = client.chat.completions.create(
        model="specd", messages=MESSAGES, max_tokens=n, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"speculative": {"policy": "heuristic"}})
    chunks = list(stream)
    assert len(chunks) >= 3
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference(n)[1]

    # spec_stats comes with the chunk carrying finish_reason; usage with a last chunk of no choices.
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finishing) == 1
    assert finishing[0].choices[0].finish_reason in ("length", "stop")
    stats = (finishing[0].model_extra or {}).get("spec_stats")
    assert isinstance(stats, dict), finishing[0]
    assert stats["policy"] == "heuristic"
    assert stats["fallback"] is False, stats["fallback_reason"]
    assert stats["verifications"] >= 1

    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == len(reference(n)[0]) == stats["new_tokens"]
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
