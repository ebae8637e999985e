"""Tests of specd.verify: greedy verification with forced-argmax logits, distribution tests of
lossless sampling verification (with negative controls that the same test must reject), and
AdaSD's relaxed verification."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import specd.verify as verify_module
from specd.sampling import argmax_rows, js_distance, sample
from specd.types import SamplingParams
from specd.verify import Verdict, verify_greedy, verify_relaxed, verify_sampling, verify_window

V = 6
N = 20_000  # verification rounds per distribution test of verify_sampling
N_SMALL = 5_000  # for the other verifiers: enough to reject a wrong one by a wide margin
ALPHA_OK = 1e-3  # a correct verifier must not be rejected at this level (fixed seeds: not flaky)
ALPHA_BAD = 1e-3  # a wrong verifier must be rejected at this level

# Target p over k+1 = 3 positions and draft q over k = 2 positions, independent of context, so
# the target alone emits token j from P[j] and the verified output must do the same.
P = torch.tensor([
    [0.30, 0.05, 0.25, 0.10, 0.20, 0.10],
    [0.10, 0.35, 0.05, 0.20, 0.10, 0.20],
    [0.15, 0.15, 0.30, 0.05, 0.25, 0.10],
])
Q = torch.tensor([
    [0.05, 0.30, 0.20, 0.25, 0.10, 0.10],
    [0.30, 0.10, 0.25, 0.05, 0.20, 0.10],
])
POINT_DRAFT = (0, 1)  # the n-gram drafter's fixed proposal for the point-mass (q = None) case


def _forced_logits(argmaxes: list[int], vocab: int = 8) -> torch.Tensor:
    """Logits [len, vocab] of random noise in [0, 1) with a forced argmax of 10 per row."""
    g = torch.Generator().manual_seed(len(argmaxes))
    logits = torch.rand(len(argmaxes), vocab, generator=g)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 10.0
    return logits


# ---- greedy -------------------------------------------------------------------------------------

@pytest.mark.parametrize("argmaxes, draft, num_accepted", [
    ([3, 1, 4, 1], [3, 1, 4], 3),  # all accepted: bonus is argmax of the last row
    ([3, 1, 4, 1], [5, 1, 4], 0),  # mismatch at the first token
    ([3, 1, 4, 1], [3, 2, 4], 1),  # mismatch in the middle; later matches do not count
    ([3, 1, 4, 1], [3, 1, 0], 2),  # mismatch at the last token
    ([7], [], 0),  # k = 0: just the target's next token
    ([2, 2, 2, 2, 2, 6], [2, 2, 2, 2, 2], 5),
])
def test_verify_greedy(argmaxes, draft, num_accepted):
    verdict = verify_greedy(_forced_logits(argmaxes), draft)
    assert verdict.num_accepted == num_accepted
    assert verdict.num_strict == num_accepted
    assert verdict.next_token == argmaxes[num_accepted]  # recovered (or bonus) token
    assert verdict.num_relaxed == 0
    # The same verdict from the argmax rows alone (a batched forward reads them for its sessions).
    assert verify_window(torch.zeros(len(argmaxes), 8), draft, None, SamplingParams(), None,
                         best=argmaxes) == verdict


NO_KERNEL = ("aten::detach", "detach", "aten::to", "aten::resolve_conj", "aten::resolve_neg")  # .numpy(): no copy


def test_a_greedy_verdict_reads_the_rows_argmax_once_then_compares_in_python():
    """A greedy window's verdict is one read of its rows' argmax, then Python: on a GPU each
    further small op was a kernel launch and each read of a value a wait for the device (6 ops
    and two reads a window before). Given the rows' argmax (read for a whole batch), no op."""
    logits, draft = _forced_logits([3, 1, 4, 1]), [3, 1, 0]
    calls = []

    def counted(x):
        calls.append(x.shape)
        return argmax_rows(x)

    def ops(**kw) -> list[str]:
        with torch.profiler.profile() as prof:
            verdict = verify_window(logits, draft, None, SamplingParams(), None, **kw)
        assert verdict == Verdict(2, 4, 2)
        return [e.name for e in prof.events() if e.cpu_parent is None and e.name not in NO_KERNEL]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(verify_module, "argmax_rows", counted)
        assert ops() == [] and calls == [(4, 8)]  # a CPU reads them through numpy: no torch op either
        assert ops(best=[3, 1, 4, 1]) == [] and len(calls) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_torchs_argmax_first_of_equal_maxima(dtype):
    x = torch.randint(0, 3, (16, 300)).to(dtype)  # many ties
    x[0, 7] = x[0, 9] = float("nan")
    assert argmax_rows(x) == x.argmax(-1).tolist()


# ---- sampling: distribution tests ----------------------------------------------------------------

def _always_accept(p, q, draft, generator) -> Verdict:
    """Negative control: keeps every draft token, so the output follows q, not p."""
    k = draft.numel()
    return Verdict(k, int(sample(p[k], generator)), k)


def _recover_from_p(p, q, draft, generator) -> Verdict:
    """Negative control: the right acceptance test, but the recovered token drawn from p
    instead of norm(max(p - q, 0))."""
    k = draft.numel()
    idx = torch.arange(k)
    u = torch.rand(k, generator=generator)
    ok = (u * q[idx, draft] <= p[idx, draft]).tolist() + [False]
    n = ok.index(False)
    return Verdict(n, int(sample(p[n], generator)), n)


def _relaxed_strict(p, q, draft, generator) -> Verdict:
    return verify_relaxed(p, q, draft, None, False, generator)


def _relaxed_always(p, q, draft, generator) -> Verdict:
    return verify_relaxed(p, q, draft, 2.0, False, generator)  # JS distance <= 1 < 2


VERIFIERS = {"verify_sampling": verify_sampling, "always_accept": _always_accept,
             "recover_from_p": _recover_from_p, "relaxed_strict": _relaxed_strict,
             "relaxed_always": _relaxed_always}


@functools.lru_cache(maxsize=None)
def _emitted(verifier: str, k: int, point_mass: bool = False, seed: int = 1234) -> np.ndarray:
    """Run independent rounds; returns the emitted tokens [rounds, k+1], -1 past a round's end."""
    g = torch.Generator().manual_seed(seed)
    n_rounds = N if verifier == "verify_sampling" else N_SMALL
    p = P[:k + 1]
    if point_mass:
        q = None
        drafts = torch.tensor(POINT_DRAFT[:k]).unsqueeze(1).expand(k, n_rounds)
    else:
        q = Q[:k]
        drafts = torch.multinomial(q, n_rounds, replacement=True, generator=g)  # x_i ~ q_i, [k, rounds]
    out = np.full((n_rounds, k + 1), -1, dtype=np.int64)
    fn = VERIFIERS[verifier]
    for t in range(n_rounds):
        draft = drafts[:, t].contiguous()
        verdict = fn(p, q, draft, g)
        n = verdict.num_accepted
        out[t, :n] = draft[:n].numpy()
        out[t, n] = verdict.next_token
    return out


def _pvalue(tokens: np.ndarray, expected: torch.Tensor) -> float:
    assert tokens.size > 1000, "too few samples for a meaningful test"
    observed = np.bincount(tokens, minlength=V)
    expected = expected.double().numpy()
    return float(chisquare(observed, expected / expected.sum() * observed.sum()).pvalue)


@pytest.mark.parametrize("verifier, k", [("verify_sampling", 1), ("verify_sampling", 2),
                                         ("relaxed_strict", 2)])
def test_first_token_follows_target(verifier, k):
    out = _emitted(verifier, k)
    assert _pvalue(out[:, 0], P[0]) > ALPHA_OK


@pytest.mark.parametrize("verifier", ["verify_sampling", "relaxed_strict"])
def test_second_token_after_acceptance_follows_target(verifier):
    # k = 2: the second token is x_2 when accepted, else recovered from the residual at position 2.
    out = _emitted(verifier, 2)
    accepted_first = out[:, 1] >= 0
    second = out[accepted_first, 1]
    assert _pvalue(second, P[1]) > ALPHA_OK
    # both paths were exercised
    rejected_second = accepted_first & (out[:, 2] < 0)
    assert 500 < rejected_second.sum() < accepted_first.sum() - 500


@pytest.mark.parametrize("verifier, k", [("verify_sampling", 1), ("verify_sampling", 2),
                                         ("relaxed_strict", 2)])
def test_bonus_token_follows_target(verifier, k):
    out = _emitted(verifier, k)
    all_accepted = out[:, k] >= 0
    assert all_accepted.sum() > 1000
    assert _pvalue(out[all_accepted, k], P[k]) > ALPHA_OK


def test_point_mass_draft_follows_target():
    out = _emitted("verify_sampling", 2, point_mass=True)
    assert _pvalue(out[:, 0], P[0]) > ALPHA_OK
    second = out[out[:, 1] >= 0, 1]
    assert _pvalue(second, P[1]) > ALPHA_OK
    assert _pvalue(out[out[:, 2] >= 0, 2], P[2]) > ALPHA_OK
    # the point-mass draft is accepted with probability p(x) / 1
    assert (out[:, 0] == POINT_DRAFT[0]).mean() == pytest.approx(float(P[0, POINT_DRAFT[0]]), abs=0.02)


def test_acceptance_rate_is_sum_of_min_p_q():
    out = _emitted("verify_sampling", 2)
    # P(x_1 accepted) = sum_v min(p(v), q(v)); the first draft is accepted iff round emits >= 2 tokens
    beta = float(torch.minimum(P[0], Q[0]).sum())
    assert (out[:, 1] >= 0).mean() == pytest.approx(beta, abs=0.015)


@pytest.mark.parametrize("verifier", ["always_accept", "recover_from_p", "relaxed_always"])
def test_negative_controls_are_rejected(verifier):
    out = _emitted(verifier, 2)
    assert _pvalue(out[:, 0], P[0]) < ALPHA_BAD
    assert _pvalue(out[out[:, 1] >= 0, 1], P[1]) < ALPHA_BAD


def test_sampling_k0_samples_from_p():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    verdict = verify_sampling(p, torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), g)
    assert (verdict.num_accepted, verdict.next_token) == (0, 2)


def test_sampling_never_accepts_token_target_excludes_and_always_accepts_when_p_ge_q():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]])
    q = torch.tensor([[0.9, 0.05, 0.05], [0.5, 0.25, 0.25]])
    for _ in range(200):
        v = verify_sampling(p, q, torch.tensor([0, 1]), g)
        assert v.num_accepted == 0 and v.next_token in (1, 2)  # p(0) = 0: rejected, residual > 0 only at 1, 2
        v = verify_sampling(p, q, torch.tensor([1, 2]), g)
        assert (v.num_accepted, v.next_token) == (2, 2)  # p >= q at both: accepted, bonus from p[2]


# ---- relaxed (AdaSD, lossy) ----------------------------------------------------------------------

def _relaxed_case(seed: int, k: int = 5):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(k + 1, V, generator=g).mul(2).softmax(-1)
    q = torch.randn(k, V, generator=g).mul(2).softmax(-1)
    # draft argmax p at random positions, something else elsewhere
    match = torch.rand(k, generator=g) < 0.6
    other = (p[:k].argmax(-1) + 1 + torch.randint(0, V - 1, (k,), generator=g)) % V
    draft = torch.where(match, p[:k].argmax(-1), other)
    return p, q, draft


@pytest.mark.parametrize("seed", range(20))
def test_relaxed_without_threshold_is_strict_greedy(seed):
    p, q, draft = _relaxed_case(seed)
    got = verify_relaxed(p, q, draft, None, True, None)
    want = verify_greedy(p.log(), draft.tolist())
    assert (got.num_accepted, got.next_token, got.num_strict, got.num_relaxed) == \
        (want.num_accepted, want.next_token, want.num_strict, 0)
    torch.testing.assert_close(torch.tensor(got.js_distances), js_distance(p[:5], q))


def test_relaxed_huge_threshold_accepts_everything():
    p, q, _ = _relaxed_case(0)
    best = p.argmax(-1)
    draft = best[:5].clone()
    draft[1] = (best[1] + 1) % V  # mismatch at 1 and 3
    draft[3] = (best[3] + 2) % V
    v = verify_relaxed(p, q, draft, 2.0, True, None)
    assert v.num_accepted == 5
    assert v.next_token == int(best[5])  # bonus
    assert v.num_strict == 1  # the lossless rule stops at the first mismatch
    assert v.num_relaxed == 2  # positions 1 and 3 were accepted only by relaxation


def test_relaxed_threshold_accepts_close_mismatch_and_stops_at_far_one():
    p = torch.tensor([
        [0.1, 0.6, 0.1, 0.1, 0.1],
        [0.40, 0.35, 0.1, 0.1, 0.05],
        [0.9, 0.025, 0.025, 0.025, 0.025],
        [0.2, 0.2, 0.2, 0.2, 0.2],
    ])
    q = torch.tensor([
        [0.1, 0.6, 0.1, 0.1, 0.1],  # equal: JS 0
        [0.35, 0.40, 0.1, 0.1, 0.05],  # close: small JS, argmax differs
        [0.025, 0.9, 0.025, 0.025, 0.025],  # far: large JS, argmax differs
    ])
    js = js_distance(p[:3], q)
    threshold = float(js[1] + js[2]) / 2
    v = verify_relaxed(p, q, torch.tensor([1, 1, 1]), threshold, True, None)
    assert (v.num_accepted, v.num_strict, v.num_relaxed) == (2, 1, 1)
    assert v.next_token == 0  # argmax p at the rejected position
    assert len(v.js_distances) == 3


def test_seeded_verification_keeps_exactly_the_targets_seeded_draws():
    """Seeded sampling: a draft is kept up to the first token that is not the target's race
    winner at its position, which is then emitted; the same call unseeded would sample."""
    from specd.sampling import logits_to_probs, race_scores

    torch.manual_seed(0)
    logits = torch.randn(4, 30)
    sp = SamplingParams(temperature=0.9, top_k=20, seed=5)
    winners = race_scores(logits_to_probs(logits, sp), 5, 20).argmax(-1).tolist()
    q = torch.full((3, 30), 1 / 30)  # the draft's distribution does not enter the rule
    assert verify_window(logits, winners[:3], q, sp, None, position=20) == Verdict(3, winners[3], 3)
    wrong = (winners[1] + 1) % 30
    assert verify_window(logits, [winners[0], wrong, winners[2]], q, sp, None, position=20) == Verdict(1, winners[1], 1)
    assert verify_window(logits[:1], [], None, sp, None, position=20).next_token == winners[0]
    relaxed = verify_window(logits, [winners[0], wrong, winners[2]], q, sp, None, None, True, position=20)
    assert (relaxed.num_accepted, relaxed.next_token, relaxed.num_strict) == (1, winners[1], 1)
    with pytest.raises(ValueError, match="position"):
        verify_window(logits, winners[:3], None, sp, None)
