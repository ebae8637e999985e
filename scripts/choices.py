"""Question: is one request with n = 4 faster than four requests of the same prompt?

Through the `specd up` stack started here (embedded target with its KV pool, cost-aware,
drafting on the target), sampled (T = 0.8) with a seed: for each prompt of the built-in set,
- `n4`: one request with n = 4 (choice i samples with seed + i);
- `concurrent`: four requests at once, n = 1, seeds seed .. seed + 3;
- `sequential`: the same four requests one after another,
in rotating order after a warm-up of each. The texts must be the same in all three (the run
checks). Reports the median per-prompt time ratio of each against n4, and the prompt positions
the target copied instead of computing (specd_target_prefill_shared_tokens_total) per mode.

    python scripts/choices.py --limit 8 --out docs/bench/choices-<machine>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specd_bench.load import _machine, stack_args  # noqa: E402
from services.cli import _plan, _stop, free_port, start_stack  # noqa: E402
from specd_bench.datasets import load_questions  # noqa: E402
from specd.costs import provenance  # noqa: E402

SHARED = "specd_target_prefill_shared_tokens_total"


async def shared_tokens(client, metrics: str) -> float:
    text = (await client.get(metrics)).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(SHARED))


async def chat(client, url: str, prompt: str, seed: int, n: int, max_tokens: int) -> list[str]:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0.8,
            "seed": seed, "n": n}
    r = await client.post(f"{url}/v1/chat/completions", json=body)
    r.raise_for_status()
    return [c["message"]["content"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


async def one(client, url: str, mode: str, prompt: str, seed: int, max_tokens: int) -> list[str]:
    if mode == "n4":
        return await chat(client, url, prompt, seed, 4, max_tokens)
    if mode == "concurrent":
        outs = await asyncio.gather(*(chat(client, url, prompt, seed + i, 1, max_tokens) for i in range(4)))
        return [o[0] for o in outs]
    return [(await chat(client, url, prompt, seed + i, 1, max_tokens))[0] for i in range(4)]


async def measure(url: str, metrics: str, prompts: list[str], max_tokens: int) -> list[dict]:
    import httpx

    modes = ["n4", "concurrent", "sequential"]
    records = []
    async with httpx.AsyncClient(timeout=600) as client:
        for mode in modes:  # each mode's first-use costs paid before any is measured
            await one(client, url, mode, prompts[0], 0, 4)
        for i, prompt in enumerate(prompts):
            order = modes[i % len(modes):] + modes[:i % len(modes)]
            for mode in order:
                before = await shared_tokens(client, metrics)
                t0 = time.perf_counter()
                texts = await one(client, url, mode, prompt, 1000 + i, max_tokens)
                seconds = time.perf_counter() - t0
                records.append({"prompt": i, "mode": mode, "seconds": round(seconds, 4), "texts": texts,
                                "shared_positions": await shared_tokens(client, metrics) - before})
    return records


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    # The built-in prompts that hold a text to work on: long prompts, where prefill matters.
    questions = sorted(load_questions(None), key=lambda q: -len(q.turns[0]))[:args.limit]
    prompts = [q.turns[0] for q in questions]
    plan = _plan(stack_args(argparse.Namespace(drafter=None, target_model="embedded", no_overlap=False), free_port()))
    procs: dict = {}
    try:
        start_stack(plan, procs, Path(tempfile.mkdtemp(prefix="specd-choices-")), 600.0)
        flags = plan[0][1]
        metrics = f"http://127.0.0.1:{flags[flags.index('--metrics-port') + 1]}/metrics"
        records = asyncio.run(measure(f"http://127.0.0.1:{plan[-1][2]}", metrics, prompts, args.max_tokens))
    finally:
        _stop(procs)
    by = {(r["prompt"], r["mode"]): r for r in records}
    same = all(by[i, m]["texts"] == by[i, "n4"]["texts"] for i in range(len(prompts)) for m in ("concurrent", "sequential"))
    summary = {"identical_texts": same}
    for mode in ("concurrent", "sequential"):
        ratios = [by[i, mode]["seconds"] / by[i, "n4"]["seconds"] for i in range(len(prompts))]
        summary[f"{mode}_over_n4_median"] = round(statistics.median(ratios), 3)
        summary[f"{mode}_over_n4"] = [round(x, 3) for x in ratios]
    for mode in ("n4", "concurrent", "sequential"):
        summary[f"{mode}_seconds_total"] = round(sum(by[i, mode]["seconds"] for i in range(len(prompts))), 3)
        summary[f"{mode}_shared_positions"] = sum(by[i, mode]["shared_positions"] for i in range(len(prompts)))
    doc = {"question": __doc__.splitlines()[0], "command": " ".join(sys.argv), "provenance": provenance(),
           "machine": _machine(), "server": "; ".join(f"{n} {' '.join(f)}" for n, f, _ in plan),
           "max_tokens": args.max_tokens, "prompt_chars": [len(p) for p in prompts], "summary": summary,
           "records": records}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
