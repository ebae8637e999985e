"""The oracle bound (DESIGN.md §3.3; SpecDec++, Huang et al. 2024, Thm 4.1) and the cost curve.

An oracle length policy knows the target's greedy output y_1..y_N. It drafts each maximal run
of tokens the draft agrees with (teacher-forced: argmax q(. | prompt, y_<i) == y_i), capped at
the window W, and verifies once per run; verification then yields the next y as the recovered
or bonus token. So round r emits len_r + 1 tokens, nothing is discarded, and without a cap
V = N_target = |disagreements| + 1.

With the measured per-token draft cost t_draft and target cost t_target(k) of a k-token forward
on a cached prefix, the best any length policy can do with this pair is
    time = t_prefill + len_0 * t_draft + sum_{r >= 1} (len_r * t_draft + t_target(len_r + 1)),
    tokens/s = N / time
(the first round's verification is the prefill forward over prompt + drafts). Approximations:
the draft's own prefill is not counted and t_target(k) is measured once, after the first
prompt + its answer; so a measured run can exceed the bound by a few percent (> 100% of oracle).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specd.drafters.base import Drafter, fit_vocab
from specd.models.loading import LoadedModel
from specd.types import SamplingParams


def oracle_rounds(agree: Sequence[bool], window: int) -> list[int]:
    """Draft lengths of the oracle's rounds; agree[i]: the draft predicts y_i given y_<i.

    A round never drafts the last remaining token (it must leave room for the verified
    token, as the engine does), so sum(len_r + 1) == N.
    """
    rounds, pos, n = [], 0, len(agree)
    while pos < n:
        cap = min(window, n - pos - 1)
        k = 0
        while k < cap and agree[pos + k]:
            k += 1
        rounds.append(k)
        pos += k + 1
    return rounds


@dataclass
class CostCurve:
    """Measured costs in seconds: t_draft per drafted token, t_target[k-1] for a k-token forward."""

    t_draft: float
    ks: list[int]
    t_target_k: list[float]

    def t_target(self, k: float) -> float:
        """Interpolate inside the measured ks; extrapolate with a least-squares line beyond."""
        ks, ts = np.asarray(self.ks, float), np.asarray(self.t_target_k, float)
        if ks[0] <= k <= ks[-1]:
            return float(np.interp(k, ks, ts))
        slope, intercept = np.polyfit(ks, ts, 1) if len(ks) > 1 else (0.0, ts[0])
        return float(max(intercept + slope * k, 0.0))

    def round_time(self, draft_len: int) -> float:
        return draft_len * self.t_draft + self.t_target(draft_len + 1)

    def to_dict(self) -> dict:
        return {"t_draft_s": self.t_draft, "k": self.ks, "t_target_s": self.t_target_k}


def bound(rounds: Sequence[int], curve: CostCurve, t_prefill: float) -> dict:
    """The oracle's verifications, time and tokens/s for one output."""
    n = sum(k + 1 for k in rounds)
    t = t_prefill + sum(curve.round_time(k) for k in rounds[1:]) + (rounds[0] * curve.t_draft if rounds else 0.0)
    return {"new_tokens": n, "verifications": len(rounds), "drafted": sum(rounds),
            "time_s": t, "tokens_per_s": n / t if t > 0 else 0.0, "draft_lengths": list(rounds)}


@torch.inference_mode()
def teacher_forced_agreement(drafter: Drafter, prompt: Sequence[int], output: Sequence[int],
                             vocab_size: int) -> list[bool]:
    """One forward of the draft over prompt + output; agree[i] = argmax at y_i's position == y_i."""
    session = drafter.open()
    try:
        n = len(output)
        if n == 0:
            return []
        logits, _ = session.kv.extend(list(prompt) + list(output[:-1]), n)  # [n, V]
        pred = fit_vocab(logits, vocab_size).argmax(-1).tolist()
    finally:
        session.close()
    return [p == y for p, y in zip(pred, output)]


def _median_time(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_t_draft(drafter: Drafter, prefix: Sequence[int], repeats: int = 7) -> float:
    """Median of single draft steps after a cached prefix (rolled back after each step)."""
    seq, params = list(prefix), SamplingParams()
    session = drafter.open()
    try:
        session.next(seq[:-1], params, None, False)  # prefill all but the last token

        def step():
            session.next(seq, params, None, False)
            session.rollback(len(seq) - 1)

        step()  # warm-up
        return _median_time(step, repeats)
    finally:
        session.close()


def measure_t_target(target: LoadedModel, prefix: Sequence[int], max_k: int = 16,
                     repeats: int = 5) -> tuple[list[int], list[float], float]:
    """(ks, median t_target(k) for k-token forwards on the cached prefix, prefill time)."""
    prefix = list(prefix)
    kv = target.session()
    try:
        t0 = time.perf_counter()
        kv.extend(prefix, 1)
        t_prefill = time.perf_counter() - t0
        ks, ts = list(range(1, max_k + 1)), []
        for k in ks:
            ids = (prefix * (k // len(prefix) + 1))[-k:]  # any k tokens: cost depends on k, not ids

            def forward():
                kv.extend(ids, k)
                kv.rollback(len(prefix))

            forward()  # warm-up
            ts.append(_median_time(forward, repeats))
    finally:
        kv.close()
    return ks, ts, t_prefill


def measure_prefill(target: LoadedModel, prompt: Sequence[int]) -> float:
    """One timed target forward over a prompt (the oracle's first verification)."""
    kv = target.session()
    try:
        t0 = time.perf_counter()
        kv.extend(list(prompt), 1)
        return time.perf_counter() - t0
    finally:
        kv.close()
