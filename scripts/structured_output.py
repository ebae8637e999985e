"""Question: does speculation pay more on structured output (a JSON schema) than on free text?

In process, the embedded target with its default drafter (retrieval) and the cost-aware policy,
greedy, on the first turns of MT-bench questions: each question once as free text and once
asking for a JSON object under a schema (response_format json_schema). For each mode the target
alone (policy none) and speculation run on the same prompt, in rotating order after a warm-up
of each; the speedup of a prompt is its time alone over its time speculating (same tokens: the
run checks they are identical). Reports per-request medians and aggregate tok/s per mode, and
how many drafts the grammar forced.

    python scripts/structured_output.py --out docs/bench/structured-output-<machine> --limit 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specd.costs import provenance  # noqa: E402
from specd.drafters import build_drafter, default_drafter  # noqa: E402
from specd.engine import SpeculativeEngine  # noqa: E402
from specd.grammar import GrammarSpec  # noqa: E402
from specd.models import load_model  # noqa: E402
from specd.types import SamplingParams, SpecParams  # noqa: E402

DATASET = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "mt_bench_question.jsonl"
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"},
                                           "keywords": {"type": "array", "items": {"type": "string"},
                                                        "maxItems": 5}},
          "required": ["answer", "keywords"], "additionalProperties": False}
ASK_JSON = (' Answer as a JSON object with keys "answer" (your answer, a string) and "keywords" '
            "(at most five keywords).")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=8, help="questions")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--policy", default="cost-aware")
    args = ap.parse_args()
    questions = [json.loads(line)["turns"][0] for line in DATASET.read_text().splitlines()[:args.limit]]
    target = load_model("embedded", device="cpu", dtype="float32")
    drafter_name = default_drafter(target.name)
    engine = SpeculativeEngine(target, build_drafter(drafter_name, target))
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA))
    modes = {"free": (lambda q: q, None), "json": (lambda q: q + ASK_JSON, grammar)}

    def run(question: str, mode: str, policy: str) -> dict:
        text, spec = modes[mode]
        prompt = target.encode_prompt([{"role": "user", "content": text(question)}], chat=True)
        sampling = SamplingParams(max_new_tokens=args.max_tokens, grammar=spec)
        t0 = time.perf_counter()
        out = engine.generate(prompt, sampling, SpecParams(policy))
        seconds = time.perf_counter() - t0
        return {"mode": mode, "policy": policy, "seconds": seconds, "tokens": len(out.token_ids),
                "ids": out.token_ids, "drafted": out.stats.drafted, "accepted": out.stats.accepted,
                "grammar_drafted": out.stats.grammar_drafted, "text": out.text}

    configs = [(m, p) for m in modes for p in ("none", args.policy)]
    for mode, policy in configs:  # warm each configuration
        run(questions[0], mode, policy)
    records = []
    for i, q in enumerate(questions):
        order = configs[i % len(configs):] + configs[:i % len(configs)]  # rotate: order and drift cancel
        records += [{"question": i, **run(q, mode, policy)} for mode, policy in order]

    summary = {}
    for mode in modes:
        alone = {r["question"]: r for r in records if r["mode"] == mode and r["policy"] == "none"}
        spec = {r["question"]: r for r in records if r["mode"] == mode and r["policy"] == args.policy}
        same = all(alone[i]["ids"] == spec[i]["ids"] for i in alone)
        ratios = [alone[i]["seconds"] / spec[i]["seconds"] for i in alone]
        tokens = sum(r["tokens"] for r in spec.values())
        drafted = sum(r["drafted"] for r in spec.values())
        summary[mode] = {
            "identical_to_target_alone": same,
            "median_speedup": round(statistics.median(ratios), 3),
            "speedups": [round(x, 3) for x in ratios],
            "aggregate_tok_s_alone": round(tokens / sum(r["seconds"] for r in alone.values()), 2),
            "aggregate_tok_s_spec": round(tokens / sum(r["seconds"] for r in spec.values()), 2),
            "acceptance": round(sum(r["accepted"] for r in spec.values()) / max(drafted, 1), 3),
            "drafted": drafted,
            "grammar_drafted": sum(r["grammar_drafted"] for r in spec.values()),
            "tokens": tokens,
        }
        if mode == "json":
            parsed = 0
            for r in spec.values():
                try:
                    json.loads(r["text"])
                    parsed += 1
                except ValueError:
                    pass
            summary[mode]["answers_that_parse"] = f"{parsed}/{len(spec)}"
    for r in records:
        del r["ids"]
    doc = {"question": __doc__.splitlines()[0], "command": " ".join(sys.argv), "provenance": provenance(),
           "drafter": drafter_name, "policy": args.policy, "max_tokens": args.max_tokens, "summary": summary,
           "records": records}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
