"""The stopping policies over the same graphed target, one process (2026-11-27, H100): cost-aware against
constant windows of 2 / 4 / 8 drafts, per drafter, greedy, MT-bench 81-88, 256 tokens. Ad hoc: run on the
device beside a carried copy of the embedded GGUF (/tmp/m/smollm2.gguf), as `python3 policies.py OUT_DIR`."""
import sys, time, json
sys.path.insert(0, ".")
from pathlib import Path
import torch
from specd.runtime import embedded
embedded.gguf_path = lambda: Path("/tmp/m/smollm2.gguf")
from specd.runtime import load_model
from specd.engine import SpeculativeEngine
from specd.drafters import build_drafter
from specd.types import SamplingParams, SpecParams
from specd.bench.datasets import load_questions
from dataclasses import replace
t = load_model("embedded", "cuda", "float32", forward="hf", cuda_graphs="off")
m = replace(t, forward="lean"); m.use_pool(8, 2048, graphs=True)
m.pool.runner.capture([(1, w, s) for w in m.pool.runner.widths for s in (256, 512, 1024)])
qs = load_questions(".gpw/mt_bench_question.jsonl", limit=8)
ids = [m.encode_prompt([{"role": "user", "content": q.turns[0]}], chat=True) for q in qs]
g = SamplingParams(max_new_tokens=256)
out = {}
def run(name, eng, spec):
    eng.generate(ids[0], replace(g, max_new_tokens=8), spec)
    torch.cuda.synchronize(); t0 = time.perf_counter()
    res = [eng.generate(p, g, spec) for p in ids]
    torch.cuda.synchronize(); dt = time.perf_counter() - t0
    n = sum(len(r.token_ids) for r in res)
    out[name] = {"tok_s": round(n / dt, 1), "rounds": sum(r.stats.verifications for r in res),
                 "drafted": sum(r.stats.drafted for r in res), "accepted": sum(r.stats.accepted for r in res),
                 "tokens": [r.token_ids for r in res]}
    print(name, out[name]["tok_s"], out[name]["rounds"], out[name]["drafted"], out[name]["accepted"], flush=True)
run("none", SpeculativeEngine(m), SpecParams(policy="none"))
for d in ("retrieval", "ngram"):
    eng = SpeculativeEngine(m, build_drafter(d, m))
    run(f"{d}-cost-aware", eng, SpecParams(policy="cost-aware"))
    for k in (2, 4, 8):
        run(f"{d}-constant-{k}", eng, SpecParams(policy="constant", policy_params={"k": k}))
run("none-again", SpeculativeEngine(m), SpecParams(policy="none"))
base = out["none"]["tokens"]
for k, v in out.items():
    v["identical"] = v.pop("tokens") == base
    v["x_none"] = round(v["tok_s"] / out["none"]["tok_s"], 3)
json.dump(out, open(sys.argv[1] + "/policies.json", "w"), indent=1)
print(json.dumps(out))
