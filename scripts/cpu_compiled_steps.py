"""CPU forward times of the KV pool, eager against compiled ahead of time (specd.runtime.aot), the
latter with torch's products and with specd's few-row product (specd.runtime.rows), on the
embedded target (docs/engine.md, "Compiled CPU forwards"): one session's decode step and
verification windows, and the same for 8 sessions in one forward, after 200-token contexts,
each including the LM head of the positions a verification reads. Medians of 9 forwards, the
pools interleaved. The first run compiles the libraries (about a minute each).

    python scripts/cpu_compiled_steps.py [--threads N]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from specd.runtime import rows
from specd.runtime.embedded import default_cache_dir
from specd.runtime.loading import load_model
from specd.runtime.pool import pooled_extend

CONTEXT = 200
# tokens of each session in one forward: decode steps, windows, and 8 sessions whose windows join
# others' decode steps (rows of unequal length, as a loaded target service batches them)
SHAPES = [[1], [2], [4], [8], [17], [1] * 8, [4] * 8, [1, 4, 1, 5, 1, 1, 3, 1]]


def median_ms(sessions, widths: list[int], repeats: int = 9) -> float:
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        pooled_extend(sessions, [[5] * w for w in widths], widths)
        times.append(time.perf_counter() - t0)
        for s in sessions:
            s.rollback(CONTEXT)
    return 1e3 * statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    pools = {}
    for name, mode, products in (("eager", "off", None), ("torch", "on", rows.disabled()),
                                 ("rows", "on", contextlib.nullcontext())):
        model = load_model("embedded", device="cpu", dtype="float32")
        with products or contextlib.nullcontext():
            model.use_pool(8, 1024, compiled=mode)
        sessions = [model.session() for _ in range(8)]
        for s in sessions:
            s.extend(list(range(100, 100 + CONTEXT)), 1)
        pools[name] = sessions
    if not rows.loaded():
        raise SystemExit(f"the few-row product did not load: {rows.load(default_cache_dir())}")
    print(f"{torch.get_num_threads()} threads, contexts of {CONTEXT} tokens; ms per forward")
    print("tokens per session | eager | compiled, torch's products | compiled, few-row product | "
          "eager / few-row | torch's / few-row")
    for widths in SHAPES:
        t = {name: median_ms(sessions[:len(widths)], widths) for name, sessions in pools.items()}
        print(f"{widths} | {t['eager']:.1f} | {t['torch']:.1f} | {t['rows']:.1f} | "
              f"{t['eager'] / t['rows']:.2f}x | {t['torch'] / t['rows']:.2f}x")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
