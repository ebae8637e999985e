"""Compile the embedded target's CPU forward ahead of time for each torch thread count given,
one process each, side by side (a library is compiled per thread count: specd/runtime/aot.py).

`make test` runs it before its two workers start, for the counts its tests' processes use: 1
(the stack's target, tests/integration/conftest.py), 2 (the tests' own processes,
tests/conftest.py) and torch's default (`specd up`'s target). A test that compiled beside the
other worker took 4-5 minutes and once outran the stack's start-up timeout.

    python scripts/compile_forwards.py [THREADS ...]    # default: 1 2 and torch's default
"""

from __future__ import annotations

import subprocess
import sys

COMPILE = ("import sys, torch; torch.set_num_threads(int(sys.argv[1])); from specd.runtime import load_model; "
           "load_model('embedded', device='cpu', dtype='float32', cpu_compile='on')")


def main(argv: list[str]) -> int:
    import torch

    from specd.runtime.embedded import embedded_dir

    counts = sorted({int(a) for a in argv} or {1, 2, torch.get_num_threads()})
    embedded_dir(None)  # dequantized once here, before the processes that read it start
    procs = [subprocess.Popen([sys.executable, "-c", COMPILE, str(n)]) for n in counts]
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
