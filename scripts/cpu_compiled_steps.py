"""CPU forward times of the KV pool, eager against compiled ahead of time (specd.models.aot), on
the embedded target (docs/engine.md, "Compiled CPU forwards"): one session's decode step and
verification windows, and the same for 8 sessions in one forward, after 200-token contexts,
each including the LM head of the positions a verification reads. Medians of 9 forwards, the
two pools interleaved. The first run compiles the library (about a minute).

    python scripts/cpu_compiled_steps.py [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specd.models.loading import load_model
from specd.models.pool import pooled_extend

CONTEXT = 200
SHAPES = [(1, 1), (1, 2), (1, 4), (1, 8), (1, 17), (8, 1), (8, 4)]  # (sessions, tokens each)


def median_ms(sessions, width: int, repeats: int = 9) -> float:
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        pooled_extend(sessions, [[5] * width] * len(sessions), [width] * len(sessions))
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
    for mode in ("off", "on"):
        model = load_model("embedded", device="cpu", dtype="float32")
        model.use_pool(8, 1024, compiled=mode)
        sessions = [model.session() for _ in range(8)]
        for s in sessions:
            s.extend(list(range(100, 100 + CONTEXT)), 1)
        pools[mode] = sessions
    print(f"{torch.get_num_threads()} threads, contexts of {CONTEXT} tokens; ms per forward")
    print("sessions x tokens | eager | compiled | eager / compiled")
    for batch, width in SHAPES:
        eager = median_ms(pools["off"][:batch], width)
        compiled = median_ms(pools["on"][:batch], width)
        print(f"{batch} x {width} | {eager:.1f} | {compiled:.1f} | {eager / compiled:.2f}x")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
