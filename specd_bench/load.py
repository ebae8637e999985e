"""`specd bench-load`: the gateway under concurrent load, as its users meet it.

It answers: how much aggregate throughput and what latency does the service give N users at
once, with speculation and without, and does speculation still pay under load? Requests are
streamed through the OpenAI-compatible API (so TTFT and inter-token latency are what a client
sees), against services it starts itself (four `specd serve` processes on loopback, as
`specd up` starts them) or against any OpenAI-compatible server (`--url`; a peer such as
`transformers serve --continuous-batching`, with `--modes peer`).

- Closed loop (`--concurrency 1,2,4,8,16`): C clients, each sending its next prompt as soon as
  its last answer ends, until every prompt has been answered once.
- Open loop (`--rates R1,R2`): requests arrive as a Poisson process of R per second whatever
  the server does (a server that falls behind builds a queue, or refuses).
- Modes: `none` (the target alone), a stopping policy's name, or `peer` (no speculative
  extension). Every mode runs the same prompts. Before any is measured, each mode answers one
  short request of its own (a warm-up, so that its first-use costs, a policy's first forward
  shapes among them, fall outside the measured runs; results.json records each as `warm_up`).
  At each load level the modes take turns, in the order given in even repeats and reversed in
  odd ones (ABBA: A B, B A, A B, ...; two repeats by default), so that slow drift of the
  machine falls on every mode alike.
- Reported per mode and load level, with the names of vLLM's serving benchmark: output
  tokens/s, requests/s, TTFT, TPOT ((e2e - TTFT) / (tokens - 1), per request), ITL (gaps
  between streamed chunks), end-to-end latency at p50/p95/p99, goodput (requests/s meeting
  --slo-ttft-ms and --slo-tpot-ms), refusals (429/503, with whether Retry-After came), errors,
  draft fallbacks, the per-request speedup against `none` at the same level, and for greedy
  runs whether every answer equals the `none` answer to the same prompt.
- `--long-prompt-tokens N`: at each closed-loop level one more request, with a prompt of about
  N tokens, arrives with the clients; its TTFT is reported apart (`long_ttft_ms`) and the
  clients' TTFT shows what its prefill cost them.
- Refused requests: how long the refusal took (`refused_ms`). When the services run here, the
  resident memory of each process (MB) after the warm-up and after each level (`memory_mb`),
  and per cell how the target's forwards went, read from its metrics (`target`): forwards/s,
  sessions and tokens per forward, the wait for returning sessions (--batch-gather) and the
  sessions a forward started without, and the share of session-steps in multi-step runs.

Writes results.json, report.md and throughput.png / latency.png under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specd_bench.cli import DATASET_HELP
from specd.errors import InvalidRequest, SpecdError

PERCENTILES = (50, 95, 99)


def add_command(sub) -> None:
    b = sub.add_parser("bench-load", help="the gateway under concurrent load: throughput and latency by "
                                          "concurrency or arrival rate, with speculation and without")
    b.add_argument("--dataset", type=Path, help=DATASET_HELP + "; first turns used")
    b.add_argument("--limit", type=int, default=16, help="prompts (each load level answers every one once)")
    b.add_argument("--offset", type=int, default=0, help="questions skipped first")
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (sampled runs; 1: not sent)")
    b.add_argument("--seed", type=int, default=None, help="per-request seed (sampled runs)")
    b.add_argument("--modes", default="none,cost-aware",
                   help="comma list: none, policy names, peer; MODE+logprobs asks for logprobs as well "
                        "(--top-logprobs alternatives), and is also compared with MODE")
    b.add_argument("--top-logprobs", type=int, default=5, help="alternatives per token of +logprobs modes")
    b.add_argument("--concurrency", default="1,2,4,8,16", help="closed-loop levels ('' for none)")
    b.add_argument("--rates", default="", help="open-loop Poisson arrival rates, requests/s (comma list)")
    b.add_argument("--duration", type=float, default=0.0,
                   help="open loop: keep arrivals coming for this many seconds, the prompts in turn (0: each "
                        "prompt once)")
    b.add_argument("--repeats", type=int, default=2,
                   help="runs of every mode at each load level, the order of the modes reversed in every "
                        "other one (ABBA: A B, then B A)")
    b.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT at most this")
    b.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT at most this")
    b.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    b.add_argument("--url", help="an OpenAI-compatible server to load (default: start specd's services here)")
    b.add_argument("--model", default="specd", help="the model name requests carry")
    b.add_argument("--drafter", help="the draft service's drafter (services started here)")
    b.add_argument("--target-model", default="embedded")
    b.add_argument("--target-flags", default="", help="extra `specd serve target` flags, e.g. '--kv-slots 0'")
    b.add_argument("--draft-flags", default="", help="extra `specd serve draft` flags, e.g. '--load-draft-caps 8:0'")
    b.add_argument("--no-overlap", action="store_true", help="PEARL off (services started here)")
    b.add_argument("--coordinators", type=int, default=1, help="coordinator processes (services started here)")
    b.add_argument("--long-prompt-tokens", type=int, default=0,
                   help="closed-loop levels: one more request with a prompt of about this many tokens "
                        "arrives with the clients (0: none)")
    b.add_argument("--out", type=Path, default=Path("bench-load-out"))
    b.set_defaults(func=cmd_bench_load)


@dataclass
class Result:
    """One request as its client saw it (times in seconds from the level's start)."""

    prompt: int
    mode: str
    level: str  # "c4" (closed loop, 4 clients) or "r2.0" (open loop, 2 requests/s)
    repeat: int
    start: float
    status: int = 0
    error: str = ""
    retry_after: bool = False
    ttft: float | None = None
    e2e: float = 0.0
    tokens: int = 0
    text: str = ""
    chunk_gaps: list[float] = field(default_factory=list)
    fallback: bool = False
    drafted: int = 0  # spec_stats: draft tokens verified, and those accepted
    accepted: int = 0
    long: bool = False  # the --long-prompt-tokens request
    prompt_tokens: int = 0


MODIFIERS = ("logprobs",)  # what MODE+NAME adds to a mode's requests


def split_mode(mode: str) -> tuple[str, list[str]]:
    """A mode's speculation (none, a policy, peer) and its modifiers (MODE+logprobs)."""
    base, *extras = mode.split("+")
    return base, extras


def request_body(mode: str, messages: list[dict], args) -> dict:
    body = {"model": args.model, "messages": messages, "max_tokens": args.max_tokens,
            "temperature": args.temperature, "stream": True, "stream_options": {"include_usage": True}}
    if args.seed is not None:
        body["seed"] = args.seed
    if args.top_p < 1.0:
        body["top_p"] = args.top_p
    mode, extras = split_mode(mode)
    if "logprobs" in extras:
        body["logprobs"], body["top_logprobs"] = True, args.top_logprobs
    if mode == "none":
        body["speculative"] = {"enabled": False}
    elif mode != "peer":
        body["speculative"] = {"policy": mode}
    return body


async def one_request(client, url: str, body: dict, result: Result, t0: float) -> Result:
    """Stream one chat completion; fills result in place (never raises for a bad answer)."""
    import httpx

    sent = time.perf_counter()
    result.start = sent - t0
    last = None
    pieces = []
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            result.status = r.status_code
            if r.status_code != 200:
                result.retry_after = "retry-after" in r.headers
                result.error = (await r.aread()).decode(errors="replace")[:300]
                result.e2e = time.perf_counter() - sent
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = json.dumps(chunk["error"])[:300]
                    continue
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") or ""
                    if text:
                        now = time.perf_counter()
                        if result.ttft is None:
                            result.ttft = now - sent
                        else:
                            result.chunk_gaps.append(now - last)
                        last = now
                        pieces.append(text)
                if chunk.get("usage"):
                    result.tokens = int(chunk["usage"].get("completion_tokens") or 0)
                    result.prompt_tokens = int(chunk["usage"].get("prompt_tokens") or 0)
                stats = chunk.get("spec_stats") or {}
                result.fallback = result.fallback or bool(stats.get("fallback"))
                if stats:
                    result.drafted, result.accepted = int(stats.get("drafted", 0)), int(stats.get("accepted", 0))
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"[:300]
    result.e2e = time.perf_counter() - sent
    result.text = "".join(pieces)
    return result


async def closed_loop(client, url: str, bodies: list[dict], mode: str, clients: int, repeat: int,
                      long_body: dict | None = None) -> tuple[list[Result], float]:
    queue = list(enumerate(bodies))
    results: list[Result] = []
    t0 = time.perf_counter()

    async def worker():
        while queue:
            i, body = queue.pop(0)
            results.append(await one_request(client, url, body, Result(i, mode, f"c{clients}", repeat, 0.0), t0))

    async def long_request():
        result = Result(LONG_PROMPT, mode, f"c{clients}", repeat, 0.0, long=True)
        results.append(await one_request(client, url, long_body, result, t0))

    extra = [long_request()] if long_body is not None else []
    await asyncio.gather(*(worker() for _ in range(clients)), *extra)
    return results, time.perf_counter() - t0


LONG_PROMPT = -2  # the prompt index of the --long-prompt-tokens request


def long_messages(questions: list[str], tokens: int) -> list[dict]:
    """A user message of about `tokens` tokens (four characters a token): the instruction, then
    the data set's questions, repeated as needed."""
    text, i = "Answer the last of these questions briefly.\n", 0
    while len(text) < 4 * tokens and questions:
        text += questions[i % len(questions)] + "\n"
        i += 1
    return [{"role": "user", "content": text[:4 * tokens]}]


async def open_loop(client, url: str, bodies: list[dict], mode: str, rate: float, repeat: int, seed: int,
                    duration: float = 0.0) -> tuple[list[Result], float]:
    """Poisson arrivals of every prompt once, or, for `duration` seconds, of the prompts in turn."""
    rng = random.Random(seed)
    t0 = time.perf_counter()
    tasks, i = [], 0
    while i < len(bodies) if duration <= 0 else time.perf_counter() - t0 < duration:
        body = bodies[i % len(bodies)]
        tasks.append(asyncio.create_task(one_request(client, url, body,
                                                     Result(i % len(bodies), mode, f"r{rate:g}", repeat, 0.0), t0)))
        i += 1
        await asyncio.sleep(rng.expovariate(rate))
    results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - t0


def percentiles(values: list[float], scale: float = 1e3) -> dict:
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    xs = sorted(values)
    return {f"p{p}": round(scale * xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))], 2) for p in PERCENTILES}


def summarize(results: list[Result], wall: float, args) -> dict:
    long = [r for r in results if r.long]
    results = [r for r in results if not r.long]
    ok = [r for r in results if r.status == 200 and not r.error]
    refused = [r for r in results if r.status in (429, 503)]
    tpot = [(r.e2e - r.ttft) / (r.tokens - 1) for r in ok if r.ttft is not None and r.tokens > 1]
    good = [r for r in ok if (args.slo_ttft_ms is None or (r.ttft or 0) * 1e3 <= args.slo_ttft_ms)
            and (args.slo_tpot_ms is None or r.tokens <= 1
                 or (r.e2e - (r.ttft or 0)) / (r.tokens - 1) * 1e3 <= args.slo_tpot_ms)]
    tokens = sum(r.tokens for r in ok)
    return {
        "requests": len(results), "completed": len(ok), "refused": len(refused),
        "refused_with_retry_after": sum(r.retry_after for r in refused),
        "errors": len(results) - len(ok) - len(refused), "fallbacks": sum(r.fallback for r in ok),
        "wall_s": round(wall, 3), "output_tokens": tokens,
        "output_tok_s": round(tokens / wall, 2) if wall > 0 else 0.0,
        "requests_per_s": round(len(ok) / wall, 3) if wall > 0 else 0.0,
        "goodput_rps": round(len(good) / wall, 3) if wall > 0 else 0.0,
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles([g for r in ok for g in r.chunk_gaps]),
        "e2e_ms": percentiles([r.e2e for r in ok]),
        "refused_ms": percentiles([r.e2e for r in refused]),
        **({"long_ttft_ms": round(1e3 * long[0].ttft, 2) if long[0].ttft is not None else None,
            "long_prompt_tokens": long[0].prompt_tokens, "long_error": long[0].error} if long else {}),
    }


def compare(cells: dict[str, dict[str, list[Result]]], greedy: bool) -> dict:
    """Per level and mode: median per-request speedup over `none` (e2e of the same prompt in the
    same repeat) and, greedy, how many answers equal the `none` answer; a MODE+modifier mode is
    also compared with MODE (`speedup_vs_MODE`)."""
    def by_prompt(results: list[Result]) -> dict:
        return {(r.prompt, r.repeat): r for r in results if r.status == 200 and not r.error}

    def pairs(base: dict, results: list[Result]) -> list[tuple[Result, Result]]:
        return [(base[r.prompt, r.repeat], r) for r in results
                if (r.prompt, r.repeat) in base and r.status == 200 and not r.error]

    def median_speedup(found: list[tuple[Result, Result]]) -> float | None:
        return round(statistics.median(b.e2e / r.e2e for b, r in found), 3) if found else None

    out = {}
    for level, by_mode in cells.items():
        base = by_prompt(by_mode.get("none", []))
        for mode, results in by_mode.items():
            entry = {}
            if mode != "none" and base:
                found = pairs(base, results)
                entry["speedup_median"] = median_speedup(found)
                if greedy:
                    entry["identical_to_none"] = f"{sum(b.text == r.text for b, r in found)}/{len(found)}"
            plain, extras = split_mode(mode)
            if extras and plain in by_mode:
                entry[f"speedup_vs_{plain}"] = median_speedup(pairs(by_prompt(by_mode[plain]), results))
            if entry:
                out.setdefault(level, {})[mode] = entry
    return out


TARGET_SAMPLES = ("specd_verify_batch_size_count", "specd_verify_batch_size_sum", "specd_target_forward_tokens_sum",
                  "specd_verify_gather_seconds_sum", "specd_verify_gather_missed_total",
                  "specd_verify_next_steps_seconds_sum",
                  "specd_target_run_steps_sum", "specd_verify_seconds_sum", "specd_verify_seconds_count")


async def scrape(client, url: str | None) -> dict[str, float]:
    """The target's counters bench-load reads per cell, summed over labels ({} without a URL)."""
    from prometheus_client.parser import text_string_to_metric_families

    if url is None:
        return {}
    text = (await client.get(url)).text
    out = dict.fromkeys(TARGET_SAMPLES, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
            elif sample.name == "specd_target_load_fit":  # a gauge: read as it stands, not summed
                out[f"load_fit_{sample.labels.get('term')}"] = sample.value
    return out


def target_stats(before: dict[str, float], after: dict[str, float], wall: float) -> dict:
    """How the target's forwards went during one cell (the difference of two scrapes)."""
    d = {k: after[k] - before.get(k, 0.0) for k in TARGET_SAMPLES if k in after}
    forwards, steps = d["specd_verify_batch_size_count"], d["specd_verify_batch_size_sum"]
    if not forwards or wall <= 0:
        return {}
    return {"forwards_per_s": round(forwards / wall, 1), "sessions_per_forward": round(steps / forwards, 2),
            "tokens_per_forward": round(d["specd_target_forward_tokens_sum"] / forwards, 2),
            "forward_ms": round(1e3 * d["specd_verify_seconds_sum"] / max(d["specd_verify_seconds_count"], 1), 3),
            "gather_ms": round(1e3 * d["specd_verify_gather_seconds_sum"] / forwards, 3),
            "missed_per_forward": round(d["specd_verify_gather_missed_total"] / forwards, 3),
            "next_steps_ms": round(1e3 * d["specd_verify_next_steps_seconds_sum"] / forwards, 3),
            "multi_step_share": round(d["specd_target_run_steps_sum"] / steps, 3) if steps else 0.0,
            # the forwards against the start-up surface at the cell's end (LoadFit's a, b)
            "fit": [round(after[f"load_fit_{t}"], 3) for t in ("base", "token")] if "load_fit_token" in after else None}


WARM_UP_TOKENS = 4  # the tokens of each mode's warm-up request


def mode_order(modes: list[str], repeat: int) -> list[str]:
    """The order in which repeat `repeat` runs the modes at a load level: as given in even
    repeats, reversed in odd ones (ABBA). Over each pair of repeats every mode's places sum
    alike, so a drift of the machine that is linear in time falls on every mode alike; with two
    modes each runs first once."""
    return list(modes) if repeat % 2 == 0 else list(reversed(modes))


async def run(args, url: str, bodies: list[dict], modes: list[str], memory=lambda: {},
              target_metrics: str | None = None) -> dict:
    """memory(): resident MB of each service process started here ({} for --url);
    target_metrics: the target's /metrics address (per-cell forward statistics)."""
    import httpx

    levels = [("c", int(c)) for c in _csv(args.concurrency)] + [("r", float(r)) for r in _csv(args.rates)]
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    summary: dict = {}
    cells: dict[str, dict[str, list[Result]]] = {}
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        warm_up = {}
        for mode in modes:  # each mode's first-use costs paid before any is measured
            warm = {**request_body(mode, bodies[0]["messages"], args), "max_tokens": WARM_UP_TOKENS}
            r = await one_request(client, url, warm, Result(-1, mode, "warm-up", 0, 0.0), time.perf_counter())
            warm_up[mode] = {"status": r.status, "e2e_ms": round(1e3 * r.e2e, 2), "tokens": r.tokens,
                             "error": r.error}
            print(f"warm-up {mode}: status {r.status}, {r.tokens} tokens in {warm_up[mode]['e2e_ms']} ms"
                  + (f", error {r.error}" if r.error else ""), flush=True)
        rss = {"start": memory()}
        long = long_messages([b["messages"][0]["content"] for b in bodies], args.long_prompt_tokens)
        for kind, value in levels:
            level = f"{kind}{value:g}"
            for repeat in range(args.repeats):
                for mode in mode_order(modes, repeat):
                    mbodies = [request_body(mode, b["messages"], args) for b in bodies]
                    before = await scrape(client, target_metrics)
                    if kind == "c":
                        long_body = request_body(mode, long, args) if args.long_prompt_tokens > 0 else None
                        results, wall = await closed_loop(client, url, mbodies, mode, value, repeat, long_body)
                    else:
                        results, wall = await open_loop(client, url, mbodies, mode, value, repeat, seed=repeat,
                                                        duration=args.duration)
                    cells.setdefault(level, {}).setdefault(mode, []).extend(results)
                    s = summarize(results, wall, args)
                    if target_metrics is not None:
                        s["target"] = target_stats(before, await scrape(client, target_metrics), wall)
                    summary.setdefault(level, {}).setdefault(mode, []).append(s)
                    print(f"{level} {mode} (repeat {repeat}): {s['output_tok_s']} tok/s, TTFT p95 "
                          f"{s['ttft_ms']['p95']} ms, e2e p95 {s['e2e_ms']['p95']} ms, refused {s['refused']}, "
                          f"errors {s['errors']}", flush=True)
            rss[f"after {level}"] = memory()
    greedy = args.temperature == 0
    return {"summary": summary, "compare": compare(cells, greedy), "memory_mb": rss, "warm_up": warm_up,
            "requests": {lvl: {m: [stored(r) for r in rs] for m, rs in by.items()} for lvl, by in cells.items()}}


STARTUP_MARKS = ("KV pool of", "CUDA graphs captured", "target forwards compiled", "compiled the CPU forward")


def startup_lines(log: str) -> list[str]:
    """What a target's log says of its start-up: its KV pool, the CUDA graphs it captured and
    how long that took, its compiled CPU forwards (each line's message, after the level)."""
    out = []
    for line in log.splitlines():
        if any(mark in line for mark in STARTUP_MARKS):
            out.append(line.split(" INFO ", 1)[-1].split(" WARNING ", 1)[-1].strip())
    return out


def results_text(doc: dict) -> str:
    """results.json: indented, but each request's record on one line (the file's bulk)."""
    head = json.dumps({k: v for k, v in doc.items() if k != "requests"}, indent=1)
    if "requests" not in doc:
        return head
    cells = ",\n".join(
        f"  {json.dumps(level)}: {{" + ", ".join(
            f"{json.dumps(mode)}: [\n" + ",\n".join("   " + json.dumps(r) for r in records) + "\n  ]"
            for mode, records in modes.items()) + "}"
        for level, modes in doc["requests"].items())
    return head[:-2] + ',\n "requests": {\n' + cells + "\n }\n}"


def stored(result) -> dict:
    """A request's record as results.json keeps it: its times to the microsecond, the gaps
    between its chunks to the tenth of a millisecond (the file's bulk)."""
    out = asdict(result)
    for key, value in out.items():
        if isinstance(value, float):
            out[key] = round(value, 6)
    out["chunk_gaps"] = [round(g, 4) for g in out["chunk_gaps"]]
    return out


def report(doc: dict) -> str:
    a = doc["settings"]
    sampling = f"T = {a['temperature']}" + (f", top-p {a['top_p']}" if a.get("top_p", 1.0) < 1.0 else "")
    lines = [f"# bench-load: {a['limit']} prompts of {Path(a['dataset']).name}, {a['max_tokens']} tokens, "
             f"{sampling}", "", f"Machine: {doc['machine']}. Server: {doc['server']}.", ""]
    if doc.get("startup"):
        up = doc["startup"]
        lines += [f"Start-up: the stack in {up['stack_s']} s; the target: " + "; ".join(up["target"]) + ".", ""]
    lines += ["| level | mode | output tok/s | req/s | TTFT p50/p95 ms | TPOT p50/p95 ms | e2e p50/p95/p99 ms "
              "| speedup vs none (median request) | identical to none | refused | errors |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for level, by_mode in doc["summary"].items():
        for mode, runs in by_mode.items():
            s = runs[0] if len(runs) == 1 else _mean_runs(runs)
            cmp = doc["compare"].get(level, {}).get(mode, {})
            lines.append(f"| {level} | {mode} | {s['output_tok_s']} | {s['requests_per_s']} | "
                         f"{s['ttft_ms']['p50']} / {s['ttft_ms']['p95']} | {s['tpot_ms']['p50']} / {s['tpot_ms']['p95']} | "
                         f"{s['e2e_ms']['p50']} / {s['e2e_ms']['p95']} / {s['e2e_ms']['p99']} | "
                         f"{cmp.get('speedup_median', '')} | {cmp.get('identical_to_none', '')} | {s['refused']} | "
                         f"{s['errors']} |")
    lines += ["", "Levels: cN = N clients in a closed loop; rX = Poisson arrivals at X requests/s. "
              "Several repeats are averaged (throughput) and their percentiles averaged; a median request's "
              "speedup pairs each request with the same prompt's in the same repeat."]
    against = [(level, mode, key[len("speedup_vs_"):], value) for level, by in doc["compare"].items()
               for mode, cmp in by.items() for key, value in cmp.items() if key.startswith("speedup_vs_")]
    if against:
        lines += ["", "Modifiers against their plain mode (median request, time plain / time modified): " + "; ".join(
            f"{level} {mode} vs {plain}: {value}x" for level, mode, plain, value in against) + "."]
    runs = [(level, mode, r) for level, by in doc["summary"].items() for mode, rs in by.items() for r in rs]
    if any("long_ttft_ms" in r for _, _, r in runs):
        lines += ["", "One long prompt among the clients (its TTFT apart; the clients' TTFT is in the table above):",
                  "", "| level | mode | long prompt tokens | its TTFT ms | error |", "|---|---|---|---|---|"]
        lines += [f"| {lvl} | {mode} | {r['long_prompt_tokens']} | {r['long_ttft_ms']} | {r['long_error'][:80]} |"
                  for lvl, mode, r in runs if "long_ttft_ms" in r]
    refusing = [(lvl, mode, r) for lvl, mode, r in runs if r["refused"]]
    if refusing:
        lines += ["", "Refusals: " + "; ".join(
            f"{lvl} {mode}: {r['refused']} ({r['refused_with_retry_after']} with Retry-After), answered in "
            f"p50 {r['refused_ms']['p50']} / p95 {r['refused_ms']['p95']} / max {r['refused_ms']['p99']} ms"
            for lvl, mode, r in refusing) + "."]
    stats = [(lvl, mode, r["target"]) for lvl, mode, r in runs if r.get("target")]
    if stats:
        lines += ["", "The target's forwards (from its metrics; forward ms: a forward to its verdicts, the mean a "
                  "session saw; gather ms: the mean wait per forward for the sessions of the last one; missed: "
                  "those it started without; next steps ms: the mean time per forward spent preparing the multi-step "
                  "runs' next steps, the target's own drafting included; fit: what its forwards cost against "
                  "the start-up surface at the level's end, a forward's base and each further token, 1 as "
                  "measured):",
                  "", "| level | mode | forwards/s | sessions/forward | tokens/forward | forward ms | gather ms "
                  "| missed/forward | next steps ms | multi-step share | fit base / token |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {lvl} | {mode} | {t['forwards_per_s']} | {t['sessions_per_forward']} | {t['tokens_per_forward']} "
                  f"| {t['forward_ms']} | {t['gather_ms']} | {t['missed_per_forward']} | {t.get('next_steps_ms', '–')} "
                  f"| {t['multi_step_share']} | {' / '.join(map(str, t['fit'])) if t.get('fit') else '–'} |"
                  for lvl, mode, t in stats]
    if doc.get("target_costs"):
        lines += ["", _surface_line(doc["target_costs"])]
    memory = {when: by for when, by in (doc.get("memory_mb") or {}).items() if by}
    if memory:
        lines += ["", "Resident memory of the services (MB): " + "; ".join(
            f"{when}: " + ", ".join(f"{name} {mb}" for name, mb in by.items()) for when, by in memory.items()) + "."]
    return "\n".join(lines) + "\n"


def _mean_runs(runs: list[dict]) -> dict:
    out = dict(runs[0])
    for key in ("output_tok_s", "requests_per_s", "refused", "errors"):
        out[key] = round(statistics.mean(r[key] for r in runs), 2)
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        out[key] = {p: (round(statistics.mean(r[key][p] for r in runs), 2) if all(r[key][p] is not None for r in runs)
                        else None) for p in runs[0][key]}
    return out


def plots(doc: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    closed = {lvl: by for lvl, by in doc["summary"].items() if lvl.startswith("c")}
    if not closed:
        return []
    xs = [int(lvl[1:]) for lvl in closed]
    modes = sorted({m for by in closed.values() for m in by})
    paths = []
    for name, key, label in (("throughput.png", "output_tok_s", "output tokens/s"),
                             ("latency.png", "e2e_ms", "end-to-end latency p95 (ms)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode in modes:
            ys = []
            for lvl in closed:
                runs = closed[lvl].get(mode)
                s = _mean_runs(runs) if runs else None
                ys.append(None if s is None else (s[key] if key == "output_tok_s" else s[key]["p95"]))
            ax.plot(xs, ys, marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        paths.append(out / name)
    return paths


async def target_costs(address: str) -> dict:
    """The cost surface the target service measured at start-up (its Info): seconds of a
    one-session forward over n = 1.. new tokens, of B sessions x 1 token, and of each further token
    in a forward of B sessions. What throughput and TTFT under load can be read against."""
    from services.common.server import channel
    from services.proto.specd.common.v1 import common_pb2
    from services.proto.specd.target.v1 import target_pb2_grpc

    async with channel(address) as ch:
        info = await target_pb2_grpc.TargetServiceStub(ch).Info(common_pb2.InfoRequest(), timeout=10)
    c = info.costs
    return {"verify_s": list(c.verify_seconds), "batch_s": list(c.batch_seconds),
            "batch_token_s": list(c.batch_token_seconds)}


def _surface_line(costs: dict) -> str:
    one, batch = costs["verify_s"], costs["batch_s"]
    parts = [f"a {n}-token forward of one session {1e3 * one[n - 1]:.1f} ms" for n in (1, 2, 9) if n <= len(one)]
    parts += [f"{b} sessions x 1 token {1e3 * batch[b - 1]:.1f} ms ({batch[b - 1] / batch[0]:.2f}x)"
              for b in (2, 4, 8, 16) if b <= len(batch) and batch[0] > 0]
    return "Target's cost surface, measured at its start-up: " + "; ".join(parts) + "."


def _rss_mb(pid: int) -> float | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def _csv(text: str) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def _machine() -> str:
    """The CPU, and the GPUs where there are any (the services started here use them by default)."""
    import os

    import torch

    from specd.costs import cpu_model

    text = f"{cpu_model()}, {os.cpu_count()} CPUs"
    if torch.cuda.is_available():
        text += "; GPUs: " + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return text


def stack_args(args, port: int) -> argparse.Namespace:
    """What `specd up` would be given for the stack bench-load starts (services.cli._plan):
    its defaults, with the drafter, target, overlap and coordinators asked for here."""
    return argparse.Namespace(port=port, drafter=args.drafter, draft_model=None, target_model=args.target_model,
                              policy="cost-aware", no_overlap=args.no_overlap, redis_url=None, dvi=False,
                              branches=None, coordinators=getattr(args, "coordinators", 1))


def cmd_bench_load(args) -> int:
    import subprocess
    import tempfile

    from services.cli import _plan, _stop, free_port, start_stack
    from specd_bench.datasets import dataset_label, load_questions
    from specd.costs import provenance

    modes = _csv(args.modes)
    if not modes:
        raise InvalidRequest("modes", "name at least one mode")
    for mode in modes:
        unknown = [e for e in split_mode(mode)[1] if e not in MODIFIERS]
        if unknown:
            raise InvalidRequest("modes", f"{mode}: unknown modifier {unknown[0]!r} (known: {', '.join(MODIFIERS)})")
    if "peer" in modes and not args.url:
        raise InvalidRequest("modes", "peer needs --url (the peer server to load)")
    if not _csv(args.concurrency) and not _csv(args.rates):
        raise InvalidRequest("concurrency", "give closed-loop levels, --rates, or both")
    questions = load_questions(args.dataset, limit=args.limit, offset=args.offset)
    bodies = [{"messages": [{"role": "user", "content": q.turns[0]}]} for q in questions]
    procs: dict[str, subprocess.Popen] = {}
    url, server, costs, startup = args.url, args.url, None, None
    try:
        if url is None:
            plan = _plan(stack_args(args, free_port()))
            for i, extra in ((0, args.target_flags), (1, args.draft_flags)):  # target, then draft
                name, flags, port = plan[i]
                plan[i] = (name, flags + extra.split(), port)
            log_dir = Path(tempfile.mkdtemp(prefix="specd-bench-load-"))
            t0 = time.perf_counter()
            start_stack(plan, procs, log_dir, 600.0)
            startup = {"stack_s": round(time.perf_counter() - t0, 1),
                       "target": startup_lines((log_dir / "target.log").read_text(errors="replace"))}
            costs = asyncio.run(target_costs(f"127.0.0.1:{plan[0][2]}"))
            url = f"http://127.0.0.1:{plan[-1][2]}"
            server = "specd services on loopback: " + "; ".join(f"{n} {' '.join(f)}" for n, f, _ in plan)
        metrics = None
        if procs:
            flags = plan[0][1]
            metrics = f"http://127.0.0.1:{flags[flags.index('--metrics-port') + 1]}/metrics"
        doc = asyncio.run(run(args, url, bodies, modes, lambda: {name: _rss_mb(p.pid) for name, p in procs.items()},
                              metrics))
    finally:
        _stop(procs)
    doc["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
    doc["settings"]["dataset"] = dataset_label(args.dataset)
    doc["machine"], doc["server"] = _machine(), server
    doc["provenance"] = provenance()  # the commit, the CPU's instruction sets, versions, threads
    if costs is not None:
        doc["target_costs"] = costs
    if startup is not None:
        doc["startup"] = startup  # the stack's start-up seconds; the target's pool, graphs, compiled forwards
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(results_text(doc))
    (args.out / "report.md").write_text(report(doc))
    written = [args.out / "results.json", args.out / "report.md", *plots(doc, args.out)]
    print(report(doc))
    print(f"wrote {', '.join(str(p) for p in written)}")
    failed = sum(s["errors"] for by in doc["summary"].values() for runs in by.values() for s in runs)
    if failed:
        raise SpecdError(f"{failed} requests failed; see {args.out / 'results.json'}")
    return 0
