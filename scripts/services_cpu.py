"""The CPU time each service process spends per streamed token: `specd up` on the embedded
defaults (or --target-model), then --concurrency clients streaming the first --prompts MT-bench
questions per policy (each client its share, one after another), with each service's user + system CPU seconds (from /proc) read before
and after. The coordinator and the gateway are one Python process each, so their CPU
milliseconds per token bound the tokens per second one of them can stream, whatever the GPU
(docs/design.md, "Thin GPU coverage").

    python scripts/services_cpu.py --dataset mt_bench_question.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

SERVICES = ("target", "draft", "coordinator", "gateway")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def stream(url: str, question: str, policy: str, max_tokens: int, temperature: float = 1.0) -> int:
    """One streamed chat completion; the completion tokens its usage reports. A refused or
    failed request raises: counted as no tokens, it would shrink the work the CPU is divided by."""
    body = {"model": "specd", "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True},
            "speculative": {"policy": policy}}
    with httpx.Client(timeout=600) as client, client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"in-stream error: {event['error']}")
            if usage := event.get("usage"):
                return usage["completion_tokens"]
    raise RuntimeError("the stream ended without reporting its usage")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", type=Path, required=True, help="MT-bench-style JSONL (first turns used)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--policies", default="none,cost-aware,none")
    p.add_argument("--concurrency", type=int, default=1, help="clients streaming at once")
    p.add_argument("--temperature", type=float, default=1.0, help="of every request (OpenAI's default, 1)")
    p.add_argument("--target-model", default="embedded",
                   help="a fast target (a tiny model directory) leaves the services' own cost, as on a GPU")
    args = p.parse_args(argv)
    questions = [json.loads(line)["turns"][0] for line in args.dataset.read_text().splitlines()[:args.prompts]]
    up = subprocess.Popen([sys.executable, "-m", "specd", "up", "--no-sample", "--target-model", args.target_model],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        for line in up.stdout:
            if "specd is up" in line:
                break
        else:
            print("specd up ended before it was up", file=sys.stderr)
            return 1
        pids = {name: int(subprocess.run(["pgrep", "-f", f"specd serve {name}"], capture_output=True, check=True,
                                         text=True).stdout.split()[0]) for name in SERVICES}
        for policy in args.policies.split(","):
            before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                one = functools.partial(stream, "http://127.0.0.1:8000", policy=policy, max_tokens=args.max_tokens,
                                        temperature=args.temperature)
                tokens = sum(pool.map(one, questions))
            wall = time.perf_counter() - t0
            per_token = {name: round((cpu_seconds(pid) - before[name]) / tokens * 1e3, 2) for name, pid in pids.items()}
            print(json.dumps({"policy": policy, "concurrency": args.concurrency, "tokens": tokens, "wall_ms_per_token": round(wall / tokens * 1e3, 2),
                              "cpu_ms_per_token": per_token}), flush=True)
    finally:
        os.killpg(up.pid, signal.SIGINT)
        up.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
