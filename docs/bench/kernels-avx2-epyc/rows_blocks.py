"""The few-row product of the working tree against an earlier commit's: the products of one
forward of the embedded model's shapes (30 layers' seven and the LM head, random weights, 2
threads), both builds loaded in one process and alternated. Run from the repository root:

    python docs/bench/kernels-avx2-epyc/rows_blocks.py [repeats] [BEFORE]

out-rows-blocks.txt: the AVX2 register blocking (3 input rows per block of 4 weight rows where
the CPU lacks AVX-512, a fused multiply-add named explicitly) against a2014b1, the default.
out-row-streams.txt: one weight row at a time for 1 row and from 6 rows (commit bfcda46, run
there, reverted after) against cad1811. Both on the 2-core AMD EPYC, 2026-11-27."""
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from specd.runtime import rows

BEFORE = "a2014b1"  # the last commit with 4 rows per block and separate multiplies and adds
COUNTS = (1, 2, 3, 4, 6, 8, 9, 12, 17)


def build(source: str, namespace: str, out_dir: Path):
    src = out_dir / f"{namespace}.cpp"
    src.write_text(source.replace("TORCH_LIBRARY(specd,", f"TORCH_LIBRARY({namespace},")
                   .replace("TORCH_LIBRARY_IMPL(specd,", f"TORCH_LIBRARY_IMPL({namespace},"))
    lib = Path(torch.__file__).parent / "lib"
    out = out_dir / f"{namespace}.so"
    subprocess.run([rows.compiler(), *rows.FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                    *[f"-I{p}" for p in cpp_extension.include_paths()], str(src), "-o", str(out),
                    f"-L{lib}", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"], check=True)
    torch.ops.load_library(str(out))
    return getattr(torch.ops, namespace).rows_linear


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    before = sys.argv[2] if len(sys.argv) > 2 else BEFORE
    torch.set_num_threads(2)
    torch.manual_seed(0)
    before_src = subprocess.run(["git", "show", f"{before}:{rows.SOURCE.relative_to(Path.cwd())}"],
                                check=True, capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as d:
        products = {"before": build(before_src, "rows_before", Path(d)),
                    "after": build(rows.SOURCE.read_text(), "rows_after", Path(d))}
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # q/k/v, o, gate/up, down
    layers = [[torch.randn(n, k) * 0.05 for n, k in shapes] for _ in range(30)]
    head = torch.randn(49152, 576) * 0.05
    counts = COUNTS
    inputs = {m: {k: torch.randn(m, k) for k in (576, 1536)} for m in counts}
    times = {(name, m): [] for name in products for m in counts}
    for rep in range(repeats):
        for m in counts:
            for name, f in (products.items() if rep % 2 else reversed(products.items())):
                x = inputs[m]
                t = time.perf_counter()
                for weights in layers:
                    for w in weights:
                        f(x[w.shape[1]], w)
                f(x[576], head)
                times[(name, m)].append(time.perf_counter() - t)
    for name, f in products.items():  # a row's result does not depend on the rows beside it
        x = inputs[17][576]
        assert torch.equal(f(x, head)[4:5], f(x[4:5], head)), name
    same = all(torch.equal(products["before"](inputs[m][k], w), products["after"](inputs[m][k], w))
               for m in counts for k, w in ((576, head), (1536, layers[0][3])))
    print(f"ms per forward's products, median [min] of {repeats}; before: {before}; "
          f"the same results bit for bit: {'yes' if same else 'no'}")
    print("| rows |", " | ".join(map(str, counts)), "|")
    for name in products:
        print(f"| {name} |", " | ".join(f"{1e3 * statistics.median(times[(name, m)]):.1f} "
                                      f"[{1e3 * min(times[(name, m)]):.1f}]" for m in counts), "|")


if __name__ == "__main__":
    main()
