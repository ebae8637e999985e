"""scripts/services_cpu.py divides each service's CPU seconds by the tokens its requests
streamed: a refused or failed request must stop the run, not count as a request that streamed
nothing (which made the policies' token totals differ and their per-token CPU wrong)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest


class _Replies(BaseHTTPRequestHandler):
    """Answers by question: 'ok' streams a usage chunk, 'refused' is a 503, 'broken' an
    in-stream error, 'cut' a stream that ends without its usage."""
    bodies: ClassVar[list[dict]] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        question = body["messages"][0]["content"]
        if question == "refused":
            self.send_response(503)
            self.send_header("Retry-After", "1")
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "overloaded"}}')
            return
        events = {"ok": [{"choices": [{"delta": {"content": "hi"}}]}, {"choices": [], "usage": {"completion_tokens": 7}}],
                  "broken": [{"error": {"message": "model error"}}],
                  "cut": [{"choices": [{"delta": {"content": "hi"}}]}]}[question]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for event in events:
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Replies)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_a_streamed_answer_counts_the_tokens_its_usage_reports(script, url):
    services_cpu = script("services_cpu")
    assert services_cpu.stream(url, "ok", "cost-aware", 16, temperature=0.0) == 7
    sent = _Replies.bodies[-1]
    assert sent["temperature"] == 0.0 and sent["speculative"] == {"policy": "cost-aware"} and sent["max_tokens"] == 16


@pytest.mark.parametrize("question, said", [("refused", "HTTP 503"), ("broken", "model error"),
                                            ("cut", "without reporting its usage")])
def test_a_refused_or_failed_request_stops_the_run(script, url, question, said):
    with pytest.raises(RuntimeError, match=said):
        script("services_cpu").stream(url, question, "none", 16)
