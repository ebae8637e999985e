"""The compiled CPU forward (AOTInductor) before and after q/k/v and gate/up became one pass of
the few-row product each (rows_linear_cat): both libraries loaded in one process, one session
after a 200-token context, decode steps and windows of 4 and 9 tokens alternated, 40 repeats.
The library before is taken from the cache by its key (the one the previous commit compiled);
run from the repository root: python docs/bench/kernels-avx2-epyc/cat_step_ab.py OLD_KEY.
out-cat-step.txt holds what it printed on the 2-core AMD EPYC, 2026-11-27."""
import statistics
import sys
import time

import torch

from specd.models import aot
from specd.models.loading import load_model
from specd.models.pool import pooled_extend

CONTEXT = 200


def main() -> None:
    old_key = sys.argv[1]
    torch.set_num_threads(2)
    sessions = {}
    for name in ("after", "before"):
        model = load_model("embedded", device="cpu", dtype="float32")
        key = aot.AotRunner._key
        if name == "before":
            aot.AotRunner._key = lambda self: old_key
        try:
            model.use_pool(2, 1024, compiled="on")
        finally:
            aot.AotRunner._key = key
        s = model.session()
        s.extend(list(range(100, 100 + CONTEXT)), 1)
        print(name, s.pool.runner.key, flush=True)
        sessions[name] = s
    times = {(n, w): [] for n in sessions for w in (1, 4, 9)}
    for rep in range(40):
        for w in (1, 4, 9):
            for name in (("after", "before") if rep % 2 else ("before", "after")):
                s = sessions[name]
                t = time.perf_counter()
                pooled_extend([s], [[5] * w], [w])
                times[(name, w)].append(time.perf_counter() - t)
                s.rollback(CONTEXT)
    for (name, w), ts in sorted(times.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{name} width {w}: median {1e3 * statistics.median(ts):.2f} "
              f"p25 {1e3 * sorted(ts)[len(ts) // 4]:.2f} min {1e3 * min(ts):.2f} ms")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
