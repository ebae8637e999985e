"""Time transformers' forward against specd's lean forward on the same model, and check that
their logits are equal to the bit (docs/engine.md, "The lean forward").

    python scripts/forward_timing.py [--model embedded] [--context 200] [--repeats 9] [--device cuda]

Prints, per window size n, the median milliseconds of one KV-cached forward over n new tokens
after a `--context`-token prefix, for each forward, and how many of 60 random windows (with
rollbacks) gave logits that differ in any bit. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specd.runtime import load_model
from specd.runtime.lean import LeanModel
from specd.runtime.session import KVSession, hf_forward

SIZES = (1, 2, 4, 6, 8, 16)


def _step_ms(session: KVSession, n: int, base: int) -> float:
    t0 = time.perf_counter()
    session.extend([5] * n, num_logits=n)
    if session.device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    session.rollback(base)
    return dt * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (on a GPU the timings synchronise)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_model(args.model, device=args.device, dtype="float32")
    lean = LeanModel(target.model)
    sessions = {"hf": KVSession(hf_forward(target.model), target.device),
                "lean": KVSession(lean.forward, target.device, lean.new_cache())}
    vocab = target.vocab_size
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (args.context,), generator=gen).tolist()
    for s in sessions.values():
        s.extend(prefix)
    differ = 0
    for step in range(60):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        a, b = (s.extend(ids, n)[0] for s in sessions.values())
        differ += not torch.equal(a, b)
        if step % 3 == 0:
            for s in sessions.values():
                s.rollback(s.length - 1)
    print(f"windows whose logits differ in any bit: {differ} of 60")
    print(f"median ms of one forward after {args.context} cached tokens, {torch.get_num_threads()} threads")
    print("| n | " + " | ".join(str(n) for n in SIZES) + " |")
    print("|---" * (len(SIZES) + 1) + "|")
    for name, s in sessions.items():
        s.rollback(args.context)
        for n in (1, 1, 6):  # warm-up
            _step_ms(s, n, args.context)
        row = [statistics.median(_step_ms(s, n, args.context) for _ in range(args.repeats)) for n in SIZES]
        print(f"| {name} | " + " | ".join(f"{ms:.1f}" for ms in row) + " |")


if __name__ == "__main__":
    main()
