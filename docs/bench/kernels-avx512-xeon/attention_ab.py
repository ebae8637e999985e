"""The pool attention (rows_attention) of the working tree against an earlier commit's, both
builds loaded in one process and alternated: 30 layers' calls with the embedded model's shapes
(9 query heads over 3 KV heads of 64), random keys and values, 2 threads. Run from the
repository root:

    python docs/bench/kernels-avx512-xeon/attention_ab.py [repeats] [BEFORE]

out-attention.txt: eight keys scored together on AVX-512 too (their 16-lane sums halved, then
the AVX2 tree) against 8124db0, where AVX-512 scored one key at a time.
out-attention-prefetch.txt: the keys and values prefetched ahead, against 92473ad.
Both on a 2-core Intel Xeon (AVX-512), 2026-11-28."""
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels-avx2-epyc"))
from rows_blocks import build

from specd.runtime import rows

LAYERS, HEADS, KV_HEADS, DIM = 30, 9, 3, 64
# (sessions, query rows each, context): a step, windows of 4 and 9, 8 sessions' steps
SHAPES = [(1, 1, 200), (1, 4, 200), (1, 9, 200), (8, 1, 200), (1, 1, 800), (1, 9, 800), (1, 1, 2000), (8, 1, 2000)]


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    before = sys.argv[2] if len(sys.argv) > 2 else "8124db0"
    torch.set_num_threads(2)
    torch.manual_seed(0)
    before_src = subprocess.run(["git", "show", f"{before}:{rows.SOURCE.relative_to(Path.cwd())}"],
                                check=True, capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as d:
        build(before_src, "rows_before", Path(d))
        build(rows.SOURCE.read_text(), "rows_after", Path(d))
    ops = {"before": torch.ops.rows_before.rows_attention, "after": torch.ops.rows_after.rows_attention}
    times = {(name, shape): [] for name in ops for shape in SHAPES}
    worst = 0.0
    for shape in SHAPES:
        sessions, width, context = shape
        columns = context + width
        kv = [(torch.randn(sessions, KV_HEADS, columns, DIM), torch.randn(sessions, KV_HEADS, columns, DIM))
              for _ in range(LAYERS)]
        q = torch.randn(sessions, HEADS, width, DIM)
        slots = torch.arange(sessions)
        qpos = (context + torch.arange(width)).repeat(sessions, 1)
        outs = {}
        for rep in range(repeats):
            for name, op in (ops.items() if rep % 2 else reversed(ops.items())):
                t = time.perf_counter()
                for k, v in kv:
                    outs[name] = op(q, k, v, slots, qpos, 0.125)
                times[(name, shape)].append(time.perf_counter() - t)
        worst = max(worst, (outs["before"] - outs["after"]).abs().max().item())
        del kv
    print(f"ms for 30 layers' attention, median [min] of {repeats}; before: {before}; "
          f"largest |before - after|: {worst:.1e}")
    print("| sessions × rows, context |", " | ".join(f"{s} × {w}, {c}" for s, w, c in SHAPES), "|")
    for name in ops:
        print(f"| {name} |", " | ".join(f"{1e3 * statistics.median(times[(name, s)]):.2f} "
                                      f"[{1e3 * min(times[(name, s)]):.2f}]" for s in SHAPES), "|")


if __name__ == "__main__":
    main()
