"""Kernel-level device check on a random model of the embedded target's shapes (kernel times do
not depend on weight values, and no model file has to travel to a lent GPU). One run answers:

1. linear: for the model's projections, does a batch of one-row matrix-vector products
   (specd.runtime.pool._rows_product) beat the matrix product for 2..32 rows in float32?
2. steps: pooled forwards replayed from CUDA graphs, per (sessions x query rows) shape, for each
   variant of the fused forward (with --before FILE: the previous one, for an A/B in one run);
   what a verification window costs against a one-row step;
3. host: for a one-row step, the host's time per forward against the GPU's (CUDA events);
4. pipelined: N sessions decoding greedily, the host reading each step's tokens back (as the
   engine does) against each step's tokens fed to the next on the device (the host never waits).

    python scripts/gpu_kernels.py --device cuda --out kernels.json
    python scripts/gpu_kernels.py --device cpu --out /tmp/kernels.json   # the dry run (a two-layer model)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import specd.runtime.pool as P  # noqa: E402
from specd.runtime.loading import LoadedModel  # noqa: E402

SHAPES = [(1, 1), (1, 2), (1, 4), (1, 8), (1, 17), (8, 1), (32, 1), (8, 4)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    p.add_argument("--before", default=None, help="a file defining hidden_fused_before(pool, x), the previous "
                                                  "fused forward, timed beside the current one")
    p.add_argument("--steps", type=int, default=128, help="decode steps in the pipelined section")
    p.add_argument("--sections", default="linear,steps,host,pipelined", help="which of linear, steps, host, "
                                                                          "pipelined to run")
    p.add_argument("--variants", default="fused-nogemv,fused", help="fused forwards to time: fused (as the pool "
                   "runs it), fused-nogemv (GEMV_ROWS 0), fused-gemv (32); --before adds fused-before")
    return p.parse_args(argv)


def model_for(device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    small = device.type == "cpu"
    cfg = LlamaConfig(vocab_size=49152 if not small else 512, hidden_size=576 if not small else 64,
                      intermediate_size=1536 if not small else 128, num_hidden_layers=30 if not small else 2,
                      num_attention_heads=9 if not small else 4, num_key_value_heads=3 if not small else 2,
                      max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
                      initializer_range=0.3)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device).eval(), cfg


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graph_time(fn, device: torch.device, calls: int = 20, replays: int = 20) -> float:
    """Milliseconds per call of fn, replayed from a CUDA graph of `calls` calls (the launch gaps of a
    real graph included); on the CPU a plain loop."""
    if device.type != "cuda":
        fn()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls * 1e3
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(replays // 5):
            g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (replays // 5) / calls)
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def linear_section(cfg, device) -> dict:
    """F.linear against _rows_product per projection shape and row count."""
    h, inter, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size, \
        cfg.hidden_size // cfg.num_attention_heads * cfg.num_key_value_heads
    shapes = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}
    gen = torch.Generator(device=device).manual_seed(1)
    out = {}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device, generator=gen) * 0.05
        for m in (1, 2, 3, 4, 8, 17, 32):
            x = torch.randn(m, k, device=device, generator=gen)
            ref = (x.double() @ w.double().T)
            a, b = torch.nn.functional.linear(x, w), P._rows_product(x, w)
            row0 = torch.nn.functional.linear(x[:1], w)  # the one-row step's own kernel
            out[f"{name}_{m}"] = {
                "linear_ms": round(graph_time(lambda x=x, w=w: torch.nn.functional.linear(x, w), device), 4),
                "rows_ms": round(graph_time(lambda x=x, w=w: P._rows_product(x, w), device), 4),
                "linear_err": float((a.double() - ref).abs().max()), "rows_err": float((b.double() - ref).abs().max()),
                "rows_row0_equals_one_row": bool(torch.equal(b[:1], row0)),
                "linear_row0_equals_one_row": bool(torch.equal(a[:1], row0))}
    return out


def pooled(model, device, variant: str, before) -> LoadedModel:
    lm = LoadedModel("probe", model, None, device, 8192, frozenset(), "lean")
    pool = lm.use_pool(40, 1024, graphs=device.type == "cuda")
    pool.fused = True
    pool.gemv_rows = {"fused-gemv": 32, "fused-nogemv": 0}.get(variant, pool.gemv_rows)  # fused: the default
    if variant == "fused-before":
        pool._hidden_fused = lambda x: before(pool, x)
    return lm


def time_rows(pool, b: int, w: int, device, start: int = 200, iters: int = 50):
    sessions = [pool.session() for _ in range(b)]
    for s in sessions:
        s.extend(list(range(3, 3 + start)), 1)

    def step():
        o = pool.forward([s.row(list(range(10, 10 + w)), w) for s in sessions])
        for s in sessions:
            s.rollback(start)
        return o
    outs = [step() for _ in range(3)][-1]
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    sync(device)
    dt = (time.perf_counter() - t0) / iters
    for s in sessions:
        s.close()
    return round(dt * 1e3, 4), outs[0][0]


@torch.inference_mode()
def host_section(lm, device, iters: int = 100) -> dict:
    """One-row steps: the host's time to issue a forward (no sync) and the GPU's time for it."""
    pool = lm.pool
    s = pool.session()
    s.extend(list(range(3, 203)), 1)
    host, gpu = [], []
    for i in range(iters + 5):
        if device.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            sync(device)
            e0.record()
        t0 = time.perf_counter()
        logits, _ = pool.forward([s.row([10 + i % 50], 1)])[0]
        t1 = time.perf_counter()
        token = int(logits[-1].argmax())
        t2 = time.perf_counter()
        if device.type == "cuda":
            e1.record()
            e1.synchronize()
        s.rollback(200)
        if i >= 5:
            host.append(t1 - t0)
            gpu.append(e0.elapsed_time(e1) if device.type == "cuda" else (t2 - t0) * 1e3)
    s.close()
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    return {"host_issue_ms": round(med(host) * 1e3, 4), "gpu_ms_incl_argmax": round(med(gpu), 4), "token": token}


@torch.inference_mode()
def pipelined_section(lm, device, steps: int) -> dict:
    """Greedy decoding of N sessions from one graphed bucket: the host reading each step's tokens
    (tolist, as the engine's verification does) against the device feeding them to the next step."""
    pool, runner = lm.pool, lm.pool.runner
    out = {}
    for n in (1, 8, 32):
        if n > pool.num_slots:
            continue
        prompts = [list(range(3 + i, 40 + i)) for i in range(n)]
        results = {}
        for mode in ("synced", "device-fed"):
            sessions = [pool.session() for _ in range(n)]
            first = [int(s.extend(p, 1)[0][-1].argmax()) for s, p in zip(sessions, prompts)]
            produced = []
            sync(device)
            t0 = time.perf_counter()
            if mode == "synced":
                tokens = first
                for _ in range(steps):
                    rows = [s.row([t], 1) for s, t in zip(sessions, tokens)]
                    logits = torch.stack([lg[-1] for lg, _ in pool.forward(rows)])
                    tokens = logits.argmax(-1).tolist()
                    produced.append(tokens)
            else:
                span = max(len(p) for p in prompts) + steps + 1
                if runner is not None:
                    key = runner.bucket(n, 1, span)
                    graph = runner.graphs.get(key) or runner._capture(key)
                    flat, replay, output = graph.flat, graph.graph.replay, lambda graph=graph: graph.output
                else:  # the CPU dry run: the same loop, each step run eagerly
                    key = (n, 1)
                    flat = pool.pack([], n, 1)
                    result: dict = {}

                    def replay(result=result, flat=flat, n=n, span=span):
                        result["h"] = pool.hidden(P.unpack(flat, n, 1, span))

                    def output(result=result):
                        return result["h"]
                fed = torch.tensor(first, device=device)
                seen = []
                for _ in range(steps):
                    rows = [s.row([0], 1) for s in sessions]  # positions from the host, ids from the device
                    pool.to_device(pool.pack(rows, key[0], key[1]), flat)
                    flat[:n].copy_(fed)
                    replay()
                    for s in sessions:
                        pool.lengths[s.slot] += 1
                    fed = pool.head(output()[:n, 0])[0].argmax(-1)
                    seen.append(fed)
                produced = torch.stack(seen).tolist()
            sync(device)
            seconds = time.perf_counter() - t0
            for s in sessions:
                s.close()
            results[mode] = {"tok_s": round(n * steps / seconds, 1), "tokens": produced}
        out[str(n)] = {"synced_tok_s": results["synced"]["tok_s"], "device_fed_tok_s": results["device-fed"]["tok_s"],
                       "identical": results["synced"]["tokens"] == results["device-fed"]["tokens"]}
        print("pipelined", n, out[str(n)], flush=True)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    device = torch.device(args.device)
    res: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "tf32": torch.backends.cuda.matmul.allow_tf32}
    model, cfg = model_for(device)
    sections = set(args.sections.split(","))
    if "linear" in sections:
        res["linear"] = linear_section(cfg, device)
        print("linear", json.dumps(res["linear"]), flush=True)
    before = None
    if args.before:
        spec = importlib.util.spec_from_file_location("fused_before", args.before)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        before = mod.hidden_fused_before
    variants = (["fused-before"] if before else []) + args.variants.split(",")
    ref, steps, models = {}, {}, {}
    for name in variants if sections & {"steps", "host", "pipelined"} else ():
        try:
            lm = models[name] = pooled(model, device, name, before)
        except Exception as e:  # noqa: BLE001 - a variant that cannot be built is reported; the others run
            res.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:3000]}"
            print("error", name, res["errors"][name], flush=True)
            continue
        if "steps" not in sections:
            continue
        r = {}
        for b, w in SHAPES:
            ms, logits = time_rows(lm.pool, b, w, device)
            key = f"{b}x{w}"
            r[key] = ms
            if key in ref:
                r[key + "_maxdiff"] = float((logits - ref[key]).abs().max())
            else:
                ref[key] = logits
        steps[name] = r
        print(name, r, flush=True)
    if steps:
        res["steps"] = steps
    if "host" in sections:
        res["host"] = {name: host_section(lm, device) for name, lm in models.items()}
        print("host", res["host"], flush=True)
    if "pipelined" in sections:
        res["pipelined"] = {name: pipelined_section(lm, device, args.steps) for name, lm in models.items()}
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
