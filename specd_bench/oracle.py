"""The oracle bound (docs/benchmarks.md; SpecDec++, Huang et al. 2024, Thm 4.1) and the cost curve.

An oracle length policy knows the target's greedy output y_1..y_N. It drafts each maximal run
of tokens the draft agrees with (teacher-forced: argmax q(. | prompt, y_<i) == y_i; under a
seed, coupled sampling makes y a function of the seed and the draft's token the race winner
argmax q / E, so the same holds with that token), capped at
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
The bound is therefore also given at the target-alone run's own cost (`ar_step`, `at_step_cost`):
each prompt's curve scaled so that one target token costs what `ar` paid per token on that prompt
in the same run. With no token agreed, that bound is `ar`'s own time.

A drafter that adds side branches to its chain (the hybrid: the model's chain, the lookup's
proposals beside it; specd.tree) keeps, in a round starting at y_s, the longer of the model's
agreeing run and the longest branch that matches y_s..; branches start at the window's root and
follow only their own continuation, so that is exactly what its tree can keep. The oracle
drafts the model's chain only where it reaches further than the branches, and pays the draft
step only for those tokens and t_target for the kept path only (the side nodes are free): an
optimistic bound, as a bound must be (`tree_rounds`, `branch_reach`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from specd.costs import CostCurve, measure_t_draft, measure_t_target
from specd.drafters.base import Drafter, fit_vocab
from specd.runtime.loading import LoadedModel
from specd.sampling import logits_to_probs, race_scores
from specd.tree import choose_branches
from specd.types import SamplingParams

__all__ = ["CostCurve", "ar_step", "at_step_cost", "bound", "branch_reach", "measure_prefill", "measure_t_draft",
           "measure_t_target", "oracle_rounds", "teacher_forced_agreement", "tree_rounds"]


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


def tree_rounds(agree: Sequence[bool], reach: Sequence[int], window: int) -> tuple[list[int], list[int]]:
    """(kept draft tokens per round, model-drafted tokens per round) for a chain plus side
    branches; agree[i]: the model's chain predicts y_i; reach[s]: how many of y_s.. the best side
    branch offered at y_<s matches. A round keeps the longer of the two (never the last token)."""
    rounds, drafted, pos, n = [], [], 0, len(agree)
    while pos < n:
        cap = min(window, n - pos - 1)
        k = 0
        while k < cap and agree[pos + k]:
            k += 1
        side = min(reach[pos], cap)
        rounds.append(max(k, side))
        drafted.append(k if k > side else 0)
        pos += rounds[-1] + 1
    return rounds, drafted


def bound(rounds: Sequence[int], curve: CostCurve, t_prefill: float,
          drafted: Sequence[int] | None = None) -> dict:
    """The oracle's verifications, time and tokens/s for one output; drafted: the draft steps
    paid per round where they differ from the tokens kept (a tree's free side branches)."""
    drafted = list(rounds if drafted is None else drafted)
    n = sum(k + 1 for k in rounds)
    t = t_prefill + (drafted[0] * curve.t_draft if rounds else 0.0)
    t += sum(d * curve.t_draft + curve.t_target(k + 1) + curve.overhead
             for k, d in zip(rounds[1:], drafted[1:]))
    return {"new_tokens": n, "verifications": len(rounds), "drafted": sum(drafted),
            "time_s": t, "tokens_per_s": n / t if t > 0 else 0.0, "draft_lengths": list(rounds)}


def ar_step(records: Sequence[dict], t_prefill: float) -> float | None:
    """What target-alone decoding (`ar`) paid per token after the prompt's prefill on one prompt:
    (wall time - prefill) / (tokens - 1), averaged over its repeats; None below two tokens."""
    steps = [(r["wall_time_s"] - t_prefill) / (r["new_tokens"] - 1) for r in records if r["new_tokens"] > 1]
    return sum(steps) / len(steps) if steps else None


def at_step_cost(curve: CostCurve, step: float) -> CostCurve:
    """The curve scaled so that a one-token target forward costs `step` (every t_target(k) alike;
    the draft's cost is kept), whatever window sizes it was measured at."""
    return dataclasses.replace(curve, scale=curve.scale * step / curve.t_target(1))


@torch.inference_mode()
def teacher_forced_agreement(drafter: Drafter, prompt: Sequence[int], output: Sequence[int],
                             vocab_size: int, coupled: SamplingParams | None = None) -> list[bool]:
    """One forward of the draft over prompt + output; agree[i]: the draft's token at y_i's
    position is y_i. Greedy: its argmax. Seeded sampling (`coupled`): its race winner there,
    argmax q / E with the seed's noise at that sequence position (specd.sampling), which is
    the token a draft model draws in the engine."""
    session = drafter.open()
    try:
        n = len(output)
        if n == 0:
            return []
        seq = list(prompt) + list(output[:-1])
        if drafter.needs_target_features:  # first-token agreement: optimistic deeper in a window
            logits = drafter.teacher_forced_logits(seq, n)
        else:
            logits, _ = session.kv.extend(seq, n)  # [n, V]
        scores = fit_vocab(logits, vocab_size)
        if coupled is not None:
            scores = race_scores(logits_to_probs(scores, coupled), coupled.seed, len(prompt))
        pred = scores.argmax(-1).tolist()
    finally:
        session.close()
    return [p == y for p, y in zip(pred, output)]


def branch_reach(drafter: Drafter, prompt: Sequence[int], output: Sequence[int], agree: Sequence[bool],
                 window: int, params: SamplingParams | None = None) -> list[int]:
    """reach[s]: the most of y_s.. that a side branch the drafter offers at y_<s matches. The
    branches are the engine's (`SpeculativeEngine._tree`, `specd.tree.choose_branches`), the
    chain being the model's agreeing run from s. Seeded sampling passes `params`: a lookup's
    coupled proposal."""
    session = drafter.open()
    try:
        seq, reach, n = list(prompt), [], len(output)
        for s in range(n):
            run = 0
            while run < window and s + run < n and agree[s + run]:
                run += 1
            chain = list(output[s:s + run])
            chosen = choose_branches(session.branches(seq, chain, drafter.branch_length, params), chain,
                                     drafter.branch_length, drafter.branches)
            best = 0
            for branch in chosen:
                m = 0
                while m < len(branch) and s + m < n and branch[m] == output[s + m]:
                    m += 1
                best = max(best, m)
            reach.append(best)
            seq.append(output[s])
    finally:
        session.close()
    return reach


def measure_prefill(target: LoadedModel, prompt: Sequence[int]) -> float:
    """One timed target forward over a prompt (the oracle's first verification)."""
    kv = target.session()
    try:
        t0 = time.perf_counter()
        kv.extend(list(prompt), 1)
        return time.perf_counter() - t0
    finally:
        kv.close()
