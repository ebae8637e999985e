"""A batched forward's windows judged at once on the device (specd.verify.verify_windows, run here
on CPU tensors) give the verdicts verify_window gives each, window by window: greedy, seeded and unseeded (with and without draft
distributions), mixed window lengths (none included) and logits wider than the vocabulary, with
the same draws from each unseeded window's generator. Unseeded output follows the target (a
chi-square test), and a batch that pairs drafts with another's distributions is caught (the
negative control)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specd.types import SamplingParams
from specd.verify import Window, verify_window, verify_windows

V = 40


def _case(rng: random.Random, kind: str, gen_seed: int):
    """(logits, window, reference's arguments) of one random window."""
    k = rng.choice([0, 1, 2, 3, 5, 8])
    vocab = rng.choice([None, V - 3])  # logits past the emitted vocabulary, sliced away
    logits = torch.randn(k + 1, V, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) * 2
    width = vocab or V
    best = logits[:, :width].argmax(-1).tolist()
    drafts = [best[j] if rng.random() < 0.7 else rng.randrange(width) for j in range(k)]
    q = None
    if kind == "greedy":
        sampling = SamplingParams(temperature=0.0)
    elif kind == "seeded":
        sampling = SamplingParams(temperature=rng.choice([0.6, 1.0]), seed=rng.randrange(1000),
                                  top_k=rng.choice([0, 10]), top_p=rng.choice([1.0, 0.9]))
    else:
        sampling = SamplingParams(temperature=rng.choice([0.7, 1.0]), top_k=rng.choice([0, 10]),
                                  top_p=rng.choice([1.0, 0.9]))
        if kind == "unseeded-q" and k:
            q = torch.rand(k, width, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) ** 3
            q = q / q.sum(-1, keepdim=True)
            drafts = [int(torch.multinomial(q[j], 1, generator=torch.Generator().manual_seed(j + k))) for j in range(k)]
    position = rng.randrange(5, 500)
    gen = torch.Generator().manual_seed(gen_seed) if kind.startswith("unseeded") else None
    return logits, Window(drafts, sampling, q, position, gen, vocab)


@pytest.mark.parametrize("on_device", [True, None])  # None: the CPU's default, window by window
@pytest.mark.parametrize("seed", range(6))
def test_the_batched_verdicts_are_each_windows_own(seed, on_device):
    rng = random.Random(seed)
    kinds = ["greedy", "seeded", "unseeded", "unseeded-q"]
    cases = [_case(rng, rng.choice(kinds), 100 * seed + i) for i in range(12)]
    cases += [_case(rng, kind, 7000 + i) for i, kind in enumerate(kinds)]  # every kind at least once
    batched = verify_windows([lg for lg, _ in cases], [w for _, w in cases], on_device)
    for (logits, w), got in zip(cases, batched):
        lg = logits[:, :w.vocab] if w.vocab else logits
        gen = torch.Generator().manual_seed(w.generator.initial_seed()) if w.generator is not None else None
        want = verify_window(lg, list(w.drafts), w.q, w.sampling, gen, position=w.position)
        assert (got.num_accepted, got.next_token, got.num_strict) == \
            (want.num_accepted, want.next_token, want.num_strict), (w.sampling, w.drafts)
        if gen is not None:  # the same draws, in the same order: the streams go on alike
            assert torch.equal(gen.get_state(), w.generator.get_state())
    assert any(v.num_accepted for v in batched) and any(v.num_accepted < len(w.drafts)
                                                        for v, (_, w) in zip(batched, cases))
    assert verify_windows([], [], on_device) == []


P = torch.tensor([[0.30, 0.05, 0.25, 0.10, 0.20, 0.10],
                  [0.10, 0.35, 0.05, 0.20, 0.10, 0.20],
                  [0.15, 0.15, 0.30, 0.05, 0.25, 0.10]])
Q = torch.tensor([[0.05, 0.30, 0.20, 0.25, 0.10, 0.10],
                  [0.30, 0.10, 0.25, 0.05, 0.20, 0.10]])


def _emitted(q: torch.Tensor, rounds: int = 4000, batch: int = 40) -> np.ndarray:
    """Tokens emitted by rounds of 2-draft windows (drafts ~ Q) judged with distributions q,
    verified 40 at a time beside a greedy window."""
    g = torch.Generator().manual_seed(5)
    out = np.full((rounds, 3), -1)
    greedy = (P.log(), Window([0, 1], SamplingParams(temperature=0.0)))
    for start in range(0, rounds, batch):
        drafts = torch.multinomial(Q, batch, replacement=True, generator=g).T.tolist()
        windows = [Window(d, SamplingParams(temperature=1.0), q, 0, g) for d in drafts]
        verdicts = verify_windows([P.log()] * batch + [greedy[0]], windows + [greedy[1]], on_device=True)[:batch]
        for t, (d, v) in enumerate(zip(drafts, verdicts)):
            out[start + t, :v.num_accepted] = d[:v.num_accepted]
            out[start + t, v.num_accepted] = v.next_token
    return out


def _pvalue(tokens: np.ndarray, expected: torch.Tensor) -> float:
    observed = np.bincount(tokens, minlength=expected.numel())
    expected = expected.double().numpy()
    return float(chisquare(observed, expected / expected.sum() * observed.sum()).pvalue)


def test_batched_unseeded_output_follows_the_target_and_a_wrong_batch_is_caught():
    out = _emitted(Q)
    assert _pvalue(out[:, 0], P[0]) > 1e-3
    assert _pvalue(out[out[:, 1] >= 0, 1], P[1]) > 1e-3
    assert _pvalue(out[out[:, 2] >= 0, 2], P[2]) > 1e-3
    wrong = _emitted(P[:2])  # drafts from Q judged as if drawn from P: every one kept, the output is Q's
    assert _pvalue(wrong[:, 0], P[0]) < 1e-3
