"""The in-process engine's host time per round: a round's wall time less the target's forwards
(the timer wraps the KV session's extend), on the embedded model, per configuration. On a GPU
this host work sits between forwards; on the CPU it is what a faster forward would leave.

    python scripts/engine_host_time.py --dataset mt_bench_question.jsonl
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specd_bench.datasets import load_questions
from specd.drafters import build_drafter
from specd.engine import SpeculativeEngine
from specd.runtime import load_model
from specd.runtime.pool import PoolSession
from specd.runtime.session import KVSession
from specd.types import SamplingParams, SpecParams

CONFIGS = {  # name: (policy, temperature, seed, top_p)
    "none": ("none", 0.0, None, 1.0), "cost-aware": ("cost-aware", 0.0, None, 1.0),
    "none-t1": ("none", 1.0, 0, 1.0), "cost-aware-t1": ("cost-aware", 1.0, 0, 1.0),
    "none-t1-unseeded": ("none", 1.0, None, 1.0), "cost-aware-t1-unseeded": ("cost-aware", 1.0, None, 1.0),
    "none-top-p": ("none", 0.7, None, 0.95), "cost-aware-top-p": ("cost-aware", 0.7, None, 0.95),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", type=Path, required=True)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--configs", default=",".join(CONFIGS))
    args = p.parse_args(argv)
    forward = {"s": 0.0}

    def timed(method):
        def run(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                return method(self, *a, **kw)
            finally:
                forward["s"] += time.perf_counter() - t0
        return run

    for cls in (PoolSession, KVSession):
        for name in ("extend", "extend_tree"):
            setattr(cls, name, timed(getattr(cls, name)))
    target = load_model("embedded", "cpu", "float32", cpu_compile="auto")
    engine = SpeculativeEngine(target, build_drafter("retrieval", target))
    ids = [target.encode_prompt([{"role": "user", "content": q.turns[0]}], chat=True)
           for q in load_questions(args.dataset, limit=args.prompts)]
    engine.generate(ids[0], SamplingParams(max_new_tokens=8), SpecParams("cost-aware"))  # warm-up, cost curve
    for name in args.configs.split(","):
        policy, temperature, seed, top_p = CONFIGS[name]
        sampling = SamplingParams(temperature=temperature, top_p=top_p, seed=seed, max_new_tokens=args.max_new_tokens)
        forward["s"], tokens, rounds = 0.0, 0, 0
        t0 = time.perf_counter()
        for prompt in ids:
            g = engine.generate(prompt, sampling, SpecParams(policy))
            tokens, rounds = tokens + len(g.token_ids), rounds + g.stats.verifications
        wall = time.perf_counter() - t0
        print(f"{name}: {tokens} tokens, {rounds} rounds, host {(wall - forward['s']) / rounds * 1e3:.3f} ms "
              f"a round, forward {forward['s'] / rounds * 1e3:.2f} ms a round", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
