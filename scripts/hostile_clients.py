"""Question: does a hostile client, holding one valid path into the gateway, slow other users?

Starts the `specd up` stack (embedded model, services/cli.py's plan) and measures, against the
goals of docs/deploy.md "Security":
1. bodies: one client streams a greedy answer while another posts 4 MiB bodies of one-character
   messages (each a 400). Arms alternate (quiet, hostile, quiet, ...), each warmed: the stream's
   largest gap between chunks and /health's latency, quiet against hostile.
2. readers: 16 streams of one API key whose clients stop reading (a 4 KiB receive buffer,
   nothing read), then a normal request of another key: is it served, and when do the 16 free
   the target's KV slots? The gateway runs with two static keys for this (`specd up` is open).

    python scripts/hostile_clients.py --out docs/bench/hostile-clients-xeon
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specd.costs import provenance  # noqa: E402
from services.cli import _plan, _stop, start_stack  # noqa: E402
from services.common.settings import GatewaySettings  # noqa: E402
from specd.cli import build_parser  # noqa: E402

CHAT = "/v1/chat/completions"
HOSTILE_KEY, NORMAL_KEY = "sk-hostile-0000", "sk-normal-0000"
STREAM = {"messages": [{"role": "user", "content": "Write a short story about a lighthouse."}],
          "max_tokens": 96, "temperature": 0, "stream": True}


def hostile_body(target_bytes: int) -> bytes:
    one = b'{"role":"user","content":"a"},'
    n = (target_bytes - 64) // len(one)
    return b'{"model":"specd","messages":[' + one * (n - 1) + one[:-1] + b'],"max_tokens":4}'


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def stream_gaps(url: str) -> list[float]:
    """Seconds between successive chunks of one streamed answer (after the first)."""
    gaps, last = [], None
    with httpx.stream("POST", url + CHAT, json=STREAM, headers=auth(NORMAL_KEY), timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    return gaps


def health_times(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=10) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.get(url + "/health")
            out.append(time.perf_counter() - t0)
            time.sleep(0.05)


def hostile(url: str, body: bytes, count: int, stop: threading.Event, codes: list[int]) -> None:
    with httpx.Client(timeout=60) as c:
        for _ in range(count):
            if stop.is_set():
                return
            codes.append(c.post(url + CHAT, content=body,
                                headers={"content-type": "application/json", **auth(HOSTILE_KEY)}).status_code)


def arm(url: str, body: bytes | None) -> dict:
    stop, health, codes = threading.Event(), [], []
    threads = [threading.Thread(target=health_times, args=(url, stop, health))]
    if body is not None:
        threads.append(threading.Thread(target=hostile, args=(url, body, 3, stop, codes)))
    for t in threads:
        t.start()
    gaps = stream_gaps(url)
    stop.set()
    for t in threads:
        t.join()
    return {"hostile": body is not None, "max_gap_s": max(gaps), "median_gap_s": statistics.median(gaps),
            "chunks": len(gaps) + 1, "health_max_s": max(health), "health_median_s": statistics.median(health),
            "hostile_codes": codes}


def kv_in_use(metrics_url: str) -> float:
    text = httpx.get(metrics_url, timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("specd_target_kv_slots_in_use{"))


def stalled_stream(port: int, max_tokens: int) -> socket.socket:
    """A streaming request whose client reads nothing, with a 4 KiB receive buffer."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    body = json.dumps({**STREAM, "max_tokens": max_tokens}).encode()
    s.sendall(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + HOSTILE_KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


def readers(url: str, port: int, metrics_url: str, n: int, timeout_s: float, max_tokens: int) -> dict:
    socks = [stalled_stream(port, max_tokens) for _ in range(n)]
    t0 = time.perf_counter()
    time.sleep(1.0)
    held = kv_in_use(metrics_url)
    r0 = time.perf_counter()
    normal = httpx.post(url + CHAT, json={**STREAM, "stream": False, "max_tokens": 16}, headers=auth(NORMAL_KEY),
                        timeout=300)
    normal_s = time.perf_counter() - r0
    trace = []
    while time.perf_counter() - t0 < timeout_s + 120:
        used = kv_in_use(metrics_url)
        trace.append((round(time.perf_counter() - t0, 1), used))
        if used == 0:
            break
        time.sleep(1.0)
    for s in socks:
        s.close()
    return {"streams": n, "kv_in_use_after_1s": held, "normal_status": normal.status_code,
            "normal_seconds": normal_s, "all_freed_after_s": trace[-1][0] if trace[-1][1] == 0 else None,
            "trace": trace}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3, help="quiet/hostile pairs")
    ap.add_argument("--no-readers", action="store_true", help="measure the bodies only")
    ap.add_argument("--send-timeout", type=float, default=GatewaySettings().stream_send_timeout_s,
                    help="the gateway's stream_send_timeout_s (default: its default)")
    ap.add_argument("--reader-tokens", type=int, default=1000, help="max_tokens of each stalled stream")
    args = ap.parse_args()
    os.environ["SPECD_GATEWAY_STREAM_SEND_TIMEOUT_S"] = str(args.send_timeout)
    os.environ["SPECD_GATEWAY_API_KEYS"] = f"{HOSTILE_KEY},{NORMAL_KEY}"
    plan = _plan(build_parser().parse_args(["up", "--port", "0"]))
    gateway_flags = plan[-1][1]
    gateway_flags[gateway_flags.index("--auth") + 1] = "required"  # the two keys above
    procs: dict = {}
    log_dir = Path(tempfile.mkdtemp(prefix="specd-hostile-"))
    try:
        start_stack(plan, procs, log_dir, 900)
        port = plan[-1][2]
        url = f"http://127.0.0.1:{port}"
        target_flags = plan[0][1]
        metrics_url = f"http://127.0.0.1:{target_flags[target_flags.index('--metrics-port') + 1]}/metrics"
        body = hostile_body((4 << 20) - 1024)
        stream_gaps(url)  # warm
        arms = []
        for _ in range(args.rounds):
            arms.append(arm(url, None))
            arms.append(arm(url, body))
        quiet = [a for a in arms if not a["hostile"]]
        loud = [a for a in arms if a["hostile"]]
        summary = {
            "quiet_max_gap_s": max(a["max_gap_s"] for a in quiet),
            "hostile_max_gap_s": max(a["max_gap_s"] for a in loud),
            "quiet_health_max_s": max(a["health_max_s"] for a in quiet),
            "hostile_health_max_s": max(a["health_max_s"] for a in loud),
            "body_bytes": len(body),
        }
        stalled = {} if args.no_readers else readers(url, port, metrics_url, 16, args.send_timeout,
                                                     args.reader_tokens)
        doc = {"question": __doc__.splitlines()[0], "provenance": provenance(), "command": " ".join(sys.argv),
               "send_timeout_s": args.send_timeout, "summary": summary, "arms": arms, "stalled_readers": stalled}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
        print(json.dumps({"summary": summary, "stalled": {k: v for k, v in stalled.items() if k != "trace"}},
                         indent=2))
        return 0
    finally:
        _stop(procs)


if __name__ == "__main__":
    raise SystemExit(main())
