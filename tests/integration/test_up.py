"""`specd up` (the README's first command) starts all four services on the embedded model,
answers its sample request and shuts everything down."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest


@pytest.mark.embedded
def test_specd_up_answers_the_sample_request_and_stops(embedded, tmp_path):
    # `embedded` first: the dequantized weights are cached before four processes need them.
    out = subprocess.run([sys.executable, "-m", "specd", "up", "--port", "0", "--exit-after-sample",
                          "--log-dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "specd gateway: http://127.0.0.1:" in out.stdout
    assert "sample request:" in out.stdout and "fallback False" in out.stdout
    assert "drafter retrieval-8" in out.stdout  # the default for the embedded target: its datastore ships
    # Every service stopped: nothing listens on their ports any more.
    ports = [int(p) for p in re.findall(r"starting \w+ on 127\.0\.0\.1:(\d+)", out.stdout)]
    assert len(ports) == 4
    for port in ports:
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still open"
