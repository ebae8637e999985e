"""Two compiled CPU forwards (AOTInductor libraries) in one process, alternated: the current
code's and an earlier one taken from the cache by its key. One session after a CONTEXT-token
context (decode steps, windows of 4 and 9 tokens), and 8 sessions' decode steps after contexts
of CONTEXT/4 and CONTEXT tokens (4 each); 40 repeats, ms. Run from the repository root:

    python docs/bench/kernels-avx2-epyc/library_ab.py OLD_KEY [CONTEXT] [--tables]

out-cat-step.txt: q/k/v in one pass of the few-row product (OLD_KEY 602faef56a5af94eb560, the
commit before it; printed by this script's first version, which ran the single session only).
out-attention.txt: the attention reading the pool in place (OLD_KEY 5d400ce376085ee56b42, before
the rotary tables became the library's inputs).
out-c-shims.txt: the operators called as C functions, not through the proxy executor (OLD_KEY
a19157cf397197fc4f3a, commit ecb6e18, --tables).
All on the 2-core AMD EPYC, 2026-11-27."""
import statistics
import sys
import time

import torch

from specd.runtime import aot
from specd.runtime.loading import load_model
from specd.runtime.pool import pooled_extend


def main() -> None:
    old_key = sys.argv[1]
    context = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    tables = "--tables" in sys.argv  # the old library takes the rotary tables as inputs too
    torch.set_num_threads(2)
    sessions = {}
    for name in ("after", "before"):
        model = load_model("embedded", device="cpu", dtype="float32")
        saved = aot.AotRunner._key, aot.AotRunner._args, aot._known_tensors
        if name == "before":  # a library from before the rotary tables became inputs (tables=False)
            args, known = aot.AotRunner._args, aot._known_tensors
            aot.AotRunner._key = lambda self: old_key
            if not tables:
                aot.AotRunner._args = lambda self, x, args=args: args(self, x)[:-1]
                aot._known_tensors = lambda pool, known=known: {**known(pool), "pool.cos": pool.cos, "pool.sin": pool.sin,
                                                                "pool.sin_signed": pool.sin_signed}
        try:
            model.use_pool(9, 2 * context + 64, compiled="on")
        finally:
            aot.AotRunner._key, aot._known_tensors = saved[0], saved[2]
        if name == "before" and not tables:
            runner = model.pool.runner
            runner._args = lambda x, args=args, runner=runner: args(runner, x)[:-1]
        aot.AotRunner._args = saved[1]
        group = [model.session() for _ in range(9)]
        for i, s in enumerate(group):
            s.extend(list(range(100, 100 + (context if i % 2 == 0 else context // 4))), 1)
        print(name, group[0].pool.runner.key, flush=True)
        sessions[name] = group
    shapes = {"1": [1], "4": [4], "9": [9], "1 x 8": [1] * 8}
    times = {(n, w): [] for n in sessions for w in shapes}
    for rep in range(40):
        for w, widths in shapes.items():
            for name in (("after", "before") if rep % 2 else ("before", "after")):
                group = sessions[name][:len(widths)]
                lengths = [s.length for s in group]
                t = time.perf_counter()
                pooled_extend(group, [[5] * n for n in widths], widths)
                times[(name, w)].append(time.perf_counter() - t)
                for s, n in zip(group, lengths):
                    s.rollback(n)
    print(f"context {context}; ms, median p25 min of 40")
    for w in shapes:
        for name in ("before", "after"):
            ts = sorted(times[(name, w)])
            print(f"{name} {w}: {1e3 * statistics.median(ts):.2f} {1e3 * ts[len(ts) // 4]:.2f} {1e3 * ts[0]:.2f}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
