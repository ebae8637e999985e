"""The GPU path, checked on a lent GPU machine (not part of the test suite, which runs on CPUs):
for float32 and bfloat16, greedy output of every drafter x policy against the target alone
(identical or not, and where it first differs), the measured cost curves, and the speed of each
against the target alone on the same prompts. The results in docs/benchmarks.md ("On a GPU")
came from this script.

    python scripts/gpu_check.py --dataset ../shared/datasets/mt_bench_question.jsonl --prompts 8 \\
        --adapter ADAPTER.safetensors --out gpu_check.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specd.costs import measure_cost_curve
from specd.drafters import NgramDrafter, build_drafter
from specd.engine import SpeculativeEngine
from specd.models import load_model
from specd.training.corpus import file_prompts
from specd.types import SamplingParams, SpecParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=8, help="every other first turn, this many")
    ap.add_argument("--adapter", help="early-exit adapter (default: the bundled one)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    args = ap.parse_args()
    texts = file_prompts([args.dataset])[::2][:args.prompts]
    greedy = SamplingParams(max_new_tokens=args.max_new_tokens)
    results = {}
    for dtype in ("float32", "bfloat16"):
        target = load_model("embedded", device="cuda", dtype=dtype)
        prompts = [target.encode_prompt(t, True) for t in texts]
        alone = [SpeculativeEngine(target).generate(p, greedy, SpecParams("none")) for p in prompts]
        t_alone = sum(o.stats.wall_time_s for o in alone)
        res = results[dtype] = {"ar_tok_s": round(sum(len(o.token_ids) for o in alone) / t_alone, 1)}
        early_exit = build_drafter("early-exit", target, adapter_path=args.adapter)  # None: the bundled one
        for name, drafter in (("ngram", NgramDrafter()), ("early-exit", early_exit)):
            curve = measure_cost_curve(target, drafter)
            res[f"curve-{name}"] = {"t_draft_ms": round(curve.t_draft * 1e3, 2),
                                    "t_target_ms": [round(x * 1e3, 2) for x in curve.t_target_k]}
            engine = SpeculativeEngine(target, drafter, costs=curve)
            for policy in ("constant", "cost-aware"):
                outs = [engine.generate(p, greedy, SpecParams(policy)) for p in prompts]
                first_diff = [next((i for i, (a, b) in enumerate(zip(o.token_ids, r.token_ids)) if a != b),
                                   min(len(o.token_ids), len(r.token_ids)))
                              for o, r in zip(outs, alone) if o.token_ids != r.token_ids]
                drafted = sum(o.stats.drafted for o in outs)
                rounds = sum(o.stats.verifications for o in outs)
                res[f"{name}/{policy}"] = {
                    "identical": f"{len(outs) - len(first_diff)}/{len(outs)}", "first_diff": first_diff,
                    "speedup": round(t_alone / sum(o.stats.wall_time_s for o in outs), 3),
                    "mean_draft_per_verification": round(drafted / max(rounds, 1), 2)}
                print(dtype, f"{name}/{policy}", res[f"{name}/{policy}"], flush=True)
        args.out.write_text(json.dumps(results, indent=1))
        del target
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
