"""Question: does speculation pay more on structured output (a JSON schema) than on free text?

In process, the embedded target with its default drafter (retrieval) and the cost-aware policy,
greedy. Two prompt sets (--set):
- mt-bench: the first turns of MT-bench questions, each once as free text and once asking for a
  JSON object under a small schema;
- extraction: schema-heavy extraction tasks generated here from a seed (contacts, orders with
  line items, events, flights, job posts, reviews: nested objects, arrays, enums, numbers), each
  once unconstrained ("free": the prompt asks for JSON, nothing enforces it) and once under its
  schema (response_format json_schema). The same prompt in both modes.
For each mode the target alone (policy none) and speculation run on the same prompt, in rotating
order after a warm-up of each; the speedup of a prompt is its time alone over its time
speculating (same tokens: the run checks they are identical). Reports per-request medians and
aggregate tok/s per mode, and how many drafts the grammar forced.

    python scripts/structured_output.py --out docs/bench/structured-output-<machine> --limit 8
    python scripts/structured_output.py --set extraction --limit 24 --out docs/bench/extraction-<machine>
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specd.costs import provenance  # noqa: E402
from specd.drafters import build_drafter, default_drafter  # noqa: E402
from specd.engine import SpeculativeEngine  # noqa: E402
from specd.grammar import GrammarSpec  # noqa: E402
from specd.runtime import load_model  # noqa: E402
from specd.types import SamplingParams, SpecParams  # noqa: E402

DATASET = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "mt_bench_question.jsonl"
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"},
                                           "keywords": {"type": "array", "items": {"type": "string"},
                                                        "maxItems": 5}},
          "required": ["answer", "keywords"], "additionalProperties": False}
ASK_JSON = (' Answer as a JSON object with keys "answer" (your answer, a string) and "keywords" '
            "(at most five keywords).")


_NAMES = ["Ana Souza", "Kenji Watanabe", "Fatima Zahra", "Lars Nilsson", "Priya Raman", "Tomás Ortega",
          "Chloé Martin", "Oluwaseun Adeyemi", "Mei Lin", "Jonas Becker", "Aisha Khan", "Diego Ferreira"]
_CITIES = ["Lisbon", "Osaka", "Casablanca", "Uppsala", "Chennai", "Valencia", "Lyon", "Lagos", "Taipei",
           "Leipzig", "Karachi", "Porto Alegre"]
_COMPANIES = ["Northwind Labs", "Bluefin Analytics", "Cedar & Pine", "Orbital Foods", "Helix Robotics",
              "Lumen Health", "Granite Logistics", "Tessellate AI"]
_PRODUCTS = [("USB-C hub", 34.9), ("desk lamp", 22.5), ("mechanical keyboard", 89.0), ("notebook", 3.75),
             ("monitor arm", 64.0), ("webcam", 49.99), ("headphones", 129.0), ("cable ties", 4.2)]
_AIRLINES = [("TAP", "TP"), ("ANA", "NH"), ("Royal Air Maroc", "AT"), ("SAS", "SK"), ("IndiGo", "6E")]
_SKILLS = ["Python", "SQL", "Kubernetes", "Rust", "TypeScript", "Spark", "Terraform", "Go", "React"]


def _obj(props: dict, required: list | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": False}


_S, _I, _N, _B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
_SCHEMAS = {
    "contact": _obj({"name": _S, "email": _S, "phone": _S, "company": _S, "city": _S}),
    "order": _obj({"order_id": _S, "customer": _S, "currency": {"enum": ["EUR", "USD", "GBP"]},
                   "items": {"type": "array", "items": _obj({"product": _S, "quantity": _I, "unit_price": _N})},
                   "total": _N}),
    "event": _obj({"title": _S, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                   "start_time": _S, "venue": _obj({"name": _S, "city": _S}), "expected_attendees": _I}),
    "flight": _obj({"passenger": _S, "airline": _S, "flight_number": _S, "from_city": _S, "to_city": _S,
                    "date": _S, "seat": _S, "cabin": {"enum": ["economy", "premium economy", "business"]}}),
    "job": _obj({"title": _S, "company": _S, "location": _S, "remote": _B,
                 "salary": _obj({"min": _I, "max": _I, "currency": _S}),
                 "skills": {"type": "array", "items": _S}}),
    "review": _obj({"product": _S, "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                    "pros": {"type": "array", "items": _S}, "cons": {"type": "array", "items": _S},
                    "would_recommend": _B}),
}


def _passage(kind: str, r: random.Random) -> str:
    name, city, company = r.choice(_NAMES), r.choice(_CITIES), r.choice(_COMPANIES)
    if kind == "contact":
        user = name.split()[0].lower()
        return (f"Hi, this is {name} from {company}. I moved to our {city} office last month, so please update "
                f"your records: you can reach me at {user}@{company.split()[0].lower()}.com or on "
                f"+{r.randint(1, 99)} {r.randint(100, 999)} {r.randint(1000, 9999)}.")
    if kind == "order":
        items = r.sample(_PRODUCTS, r.randint(2, 3))
        lines = [(p, r.randint(1, 4), price) for p, price in items]
        listed = ", ".join(f"{q} x {p} at {price:.2f} each" for p, q, price in lines)
        return (f"Order #{r.randint(10000, 99999)} was placed by {name} and paid in euros: {listed}. The total "
                f"charged was {sum(q * price for _, q, price in lines):.2f}.")
    if kind == "event":
        return (f"Join us for the {company} Summer Meetup on {r.randint(1, 28)} July 2027, starting at "
                f"{r.randint(5, 8)}:30 pm at the Old Harbour Hall in {city}. We expect about "
                f"{r.randint(4, 30) * 10} people.")
    if kind == "flight":
        airline, code = r.choice(_AIRLINES)
        return (f"Booking confirmed for {name}: {airline} flight {code}{r.randint(100, 999)} from {city} to "
                f"{r.choice(_CITIES)} on {r.randint(1, 28)} March 2027, seat {r.randint(1, 40)}{r.choice('ABCDEF')}, "
                f"{r.choice(['economy', 'premium economy', 'business'])} class.")
    if kind == "job":
        low = r.randint(6, 12) * 10000
        return (f"{company} is hiring a Senior Data Engineer in {city} ({r.choice(['fully remote', 'on site'])}). "
                f"The salary range is {low} to {low + 20000} EUR a year. You should know "
                f"{', '.join(r.sample(_SKILLS, 3))}.")
    product = r.choice(_PRODUCTS)[0]
    return (f"I bought the {product} two weeks ago. It is well built and the price was fair, but the "
            f"instructions were confusing and delivery took ages. I'd give it {r.randint(2, 5)} stars and "
            f"{r.choice(['would', 'would not'])} recommend it to a friend.")


def extraction_tasks(n: int, seed: int = 0) -> list[tuple[str, dict]]:
    """n extraction prompts and their schemas, the same for a seed."""
    r, kinds, out = random.Random(seed), list(_SCHEMAS), []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        schema = _SCHEMAS[kind]
        prompt = (f"Extract the {kind} details from the text below as one JSON object with the keys "
                  f"{', '.join(schema['properties'])}. Answer with the JSON only.\n\n{_passage(kind, r)}")
        out.append((prompt, schema))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=8, help="questions")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--policy", default="cost-aware")
    ap.add_argument("--set", choices=("mt-bench", "extraction"), default="mt-bench")
    args = ap.parse_args()
    if args.set == "extraction":
        tasks = extraction_tasks(args.limit)
        questions = [prompt for prompt, _ in tasks]
        schemas = {prompt: GrammarSpec("json_schema", json.dumps(schema)) for prompt, schema in tasks}
        modes = {"free": (lambda q: q, lambda q: None), "json": (lambda q: q, schemas.get)}
    else:
        questions = [json.loads(line)["turns"][0] for line in DATASET.read_text().splitlines()[:args.limit]]
        grammar = GrammarSpec("json_schema", json.dumps(SCHEMA))
        modes = {"free": (lambda q: q, lambda q: None), "json": (lambda q: q + ASK_JSON, lambda q: grammar)}
    target = load_model("embedded", device="cpu", dtype="float32")
    drafter_name = default_drafter(target.name)
    engine = SpeculativeEngine(target, build_drafter(drafter_name, target))

    def run(question: str, mode: str, policy: str) -> dict:
        text, spec = modes[mode]
        prompt = target.encode_prompt([{"role": "user", "content": text(question)}], chat=True)
        sampling = SamplingParams(max_new_tokens=args.max_tokens, grammar=spec(question))
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
           "set": args.set, "drafter": drafter_name, "policy": args.policy, "max_tokens": args.max_tokens,
           "summary": summary, "records": records}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
