"""Step times of the pooled forward by kernel path, on a random model of the embedded target's
shapes (kernel times do not depend on weight values, and no model file has to travel to a lent
GPU): the exact path, the fused path with a fused attention kernel, and the fused path with
attention as batched matrix products (specd.models.pool.MATMUL_ATTENTION_WIDTH), each captured
in CUDA graphs, for (sessions x query rows) shapes; maxdiff: the largest logit difference from
the exact path's.

    python scripts/gpu_step_times.py cuda step_times.json   # (cpu: a two-layer dry run)
"""
import json, sys, time, os
import torch
from transformers import LlamaConfig, LlamaForCausalLM
sys.path.insert(0, os.getcwd())
import specd.models.pool as P
from specd.models.loading import LoadedModel
dev = torch.device(sys.argv[1]); out_path = sys.argv[2]
small = dev.type == "cpu"
cfg = LlamaConfig(vocab_size=49152, hidden_size=576 if not small else 64, intermediate_size=1536 if not small else 128,
                  num_hidden_layers=30 if not small else 2, num_attention_heads=9 if not small else 4,
                  num_key_value_heads=3 if not small else 2, max_position_embeddings=8192, rope_theta=100000.0,
                  tie_word_embeddings=True)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).to(dev).eval()
res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__}
def sync():
    if dev.type == "cuda": torch.cuda.synchronize()
def time_rows(pool, b, w, start=200, iters=50):
    sessions = [pool.session() for _ in range(b)]
    for s in sessions: s.extend(list(range(3, 3 + start)), 1)
    outs = []
    def step():
        rows = [s.row(list(range(10, 10 + w)), w) for s in sessions]
        o = pool.forward(rows)
        for s in sessions: s.rollback(start)
        return o
    for _ in range(3): outs = step()
    sync(); t0 = time.perf_counter()
    for _ in range(iters): step()
    sync(); dt = (time.perf_counter() - t0) / iters
    for s in sessions: s.close()
    return round(dt * 1e3, 3), outs[0][0]
shapes = [(1, 1), (1, 2), (1, 4), (1, 8), (1, 17), (8, 1), (32, 1), (8, 4)]
ref = {}
for name, fused, width in (("exact", False, 32), ("fused-sdpa", True, 0), ("fused-matmul", True, 32)):
    P.MATMUL_ATTENTION_WIDTH = width
    lm = LoadedModel("probe", model, None, dev, 8192, frozenset(), "lean")
    pool = lm.use_pool(40, 1024, graphs=dev.type == "cuda")
    pool.fused = fused
    r = {}
    for b, w in shapes:
        ms, logits = time_rows(pool, b, w)
        key = f"{b}x{w}"
        r[key] = ms
        if key in ref: r[key + "_maxdiff"] = float((logits - ref[key]).abs().max())
        else: ref[key] = logits
    res[name] = r
    print(name, r, flush=True)
json.dump(res, open(out_path, "w"), indent=1)
