"""Tests of specd.sampling: the distribution tokens are drawn from, entropy and JS distance."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from specd.sampling import entropy, js_distance, logits_to_probs, race_noise, race_scores, sample
from specd.types import SamplingParams


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


@pytest.mark.parametrize("temperature", [0.25, 0.7, 1.0, 2.0, 10.0])
def test_temperature_is_scaled_softmax(temperature):
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0], [0.0, 0.0, 1.0, -4.0, 2.5]])
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature))
    torch.testing.assert_close(probs, torch.softmax(logits / temperature, -1))
    assert probs.dtype == torch.float32


def test_higher_temperature_flattens():
    logits = torch.tensor([3.0, 1.0, 0.0, -2.0])
    cold = logits_to_probs(logits, SamplingParams(temperature=0.5))
    hot = logits_to_probs(logits, SamplingParams(temperature=2.0))
    assert float(entropy(hot)) > float(entropy(cold))
    assert float(cold.max()) > float(hot.max())


@pytest.mark.parametrize("top_k", [1, 2, 3, 5])
def test_top_k_keeps_exactly_k_most_likely(top_k):
    logits = torch.tensor([[0.1, 2.0, -1.0, 3.0, 0.7, 1.5], [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=top_k))
    kept = probs > 0
    assert kept.sum(-1).tolist() == [top_k, top_k]
    for row in range(2):
        top = set(torch.topk(logits[row], top_k).indices.tolist())
        assert set(kept[row].nonzero().flatten().tolist()) == top
        # the kept tokens keep their relative odds: a softmax over the kept logits only
        idx = sorted(top)
        torch.testing.assert_close(probs[row, idx], torch.softmax(logits[row, idx], -1))
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))


@pytest.mark.parametrize("top_k", [0, 6, 100])
def test_top_k_off_or_at_least_vocab_keeps_everything(top_k):
    logits = torch.tensor([0.1, 2.0, -1.0, 3.0, 0.7, 1.5])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=top_k))
    torch.testing.assert_close(probs, torch.softmax(logits, -1))


@pytest.mark.parametrize("top_p, num_kept", [
    (0.3, 1), (0.5, 1), (0.51, 2), (0.8, 2), (0.81, 3), (0.95, 3), (0.96, 4), (1.0, 4)])
def test_top_p_keeps_smallest_prefix_reaching_mass(top_p, num_kept):
    probs_in = [0.15, 0.5, 0.05, 0.3]  # sorted: 0.5, 0.3, 0.15, 0.05 (cumulative 0.5, 0.8, 0.95, 1)
    probs = logits_to_probs(_logits(probs_in), SamplingParams(temperature=1.0, top_p=top_p))
    kept = (probs > 0).nonzero().flatten().tolist()
    order = [1, 3, 0, 2]  # token ids by decreasing probability
    assert sorted(kept) == sorted(order[:num_kept])
    expected = torch.zeros(4)
    mass = sum(probs_in[i] for i in order[:num_kept])
    for i in order[:num_kept]:
        expected[i] = probs_in[i] / mass
    torch.testing.assert_close(probs, expected)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_p=5e-324),  # 0 in float32
                                    SamplingParams(temperature=1e-300),  # logits / T overflow
                                    SamplingParams(temperature=1e-30, top_k=2, top_p=1e-40)])
def test_extreme_parameters_give_the_most_likely_token_not_nan(params):
    """Found by fuzzing the gateway: each of these was a 500 (multinomial on nan)."""
    logits = torch.tensor([[0.1, 2.0, -1.0, 3.0], [9.0, 2.0, -1.0, 3.0]])
    probs = logits_to_probs(logits, params)
    expected = torch.zeros(2, 4)
    expected[0, 3] = expected[1, 0] = 1.0
    assert torch.equal(probs, expected)
    assert sample(probs, torch.Generator().manual_seed(0)).tolist() == [3, 0]


def _top_p_by_sorting(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """top-p over a full sort of each row: what specd did before its top-k search."""
    logits = (logits - logits.amax(-1, keepdim=True)) / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < torch.topk(logits, params.top_k, dim=-1).values[..., -1:], float("-inf"))
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    drop = probs.cumsum(-1) - probs >= params.top_p
    drop[..., 0] = False
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf"))
                                                          ).softmax(-1)


@pytest.mark.parametrize("scale, temperature, top_k, top_p", [
    (8.0, 0.7, 0, 0.9),  # peaked: the set ends among the first 64
    (4.0, 1.0, 0, 0.9),  # among the first 1,024
    (0.5, 1.0, 0, 0.95),  # flat: tens of thousands of tokens, the whole row sorted
    (2.0, 0.7, 0, 0.5),
    (2.0, 1.3, 40, 0.9),  # top-k first: fewer candidates than the first look
    (4.0, 1.0, 0, 1e-9),  # only the most likely token
])
def test_top_p_keeps_the_tokens_a_full_sort_keeps(scale, temperature, top_k, top_p):
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(5, 49_152, generator=g) * scale
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    got, want = logits_to_probs(logits, params), _top_p_by_sorting(logits, params)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(logits_to_probs(logits[2], params), want[2])  # one row alone


def test_top_k_then_top_p_compose():
    # top-k 3 renormalises [0.5, 0.3, 0.15] to [0.526, 0.316, 0.158]; top-p 0.8 then needs 2 tokens
    probs = logits_to_probs(_logits([0.5, 0.3, 0.15, 0.05]),
                            SamplingParams(temperature=1.0, top_k=3, top_p=0.8))
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_greedy_is_point_mass_at_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 3.0], [9.0, 2.0, -1.0, 3.0], [0.0, 0.0, 7.0, -3.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0, top_k=2, top_p=0.5))
    expected = torch.zeros(3, 4)
    expected[0, 3] = expected[1, 0] = expected[2, 2] = 1.0
    assert torch.equal(probs, expected)


def test_sample_draws_from_each_row():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    g = torch.Generator().manual_seed(0)
    assert sample(probs, g).tolist() == [1, 2]
    assert sample(probs[0], g).shape == ()


def test_sample_follows_each_row_never_drawing_a_token_of_probability_zero():
    """Chi-square per row against its (unnormalised) weights; zeros at the ends and inside; the
    negative control, the counts tested against the other row's weights, must fail."""
    weights = torch.tensor([[0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 2.0, 1.5, 0.0],
                            [0.0, 0.2, 0.4, 0.0, 0.1, 2.0, 0.1, 0.2, 0.0]])
    n = 20_000
    draws = sample(weights.expand(n, -1, -1), torch.Generator().manual_seed(5))
    assert draws.shape == (n, 2)
    for row in range(2):
        counts = torch.bincount(draws[:, row], minlength=weights.shape[1]).double()
        assert counts[weights[row] == 0].sum() == 0, counts
        kept = weights[row] > 0
        expected = weights[row][kept].double() / weights[row].sum() * n
        assert chisquare(counts[kept].numpy(), expected.numpy()).pvalue > 1e-3
        other = weights[1 - row][kept].double()
        assert chisquare(counts[kept].numpy(), (other / other.sum() * n).numpy()).pvalue < 1e-6


def test_a_uniform_that_rounds_up_to_the_total_draws_the_last_token_of_positive_probability(monkeypatch):
    """u * total can round up to the total (u just below 1): past every cumulative sum, it must
    draw the last token the row can produce, not one beyond it, nor a masked one."""
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.ones(shape, dtype=kw["dtype"]))
    assert sample(torch.tensor([[0.25, 0.75, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0]]), None).tolist() == [1, 2]


@pytest.mark.parametrize("vocab", [1, 2, 6, 1000])
def test_entropy_of_uniform_is_log_v(vocab):
    assert float(entropy(torch.full((vocab,), 1.0 / vocab))) == pytest.approx(math.log(vocab), abs=1e-5)


def test_entropy_point_mass_zero_and_known_value():
    assert float(entropy(torch.tensor([0.0, 1.0, 0.0]))) == 0.0
    p = [0.5, 0.25, 0.25]
    assert float(entropy(torch.tensor(p))) == pytest.approx(-sum(x * math.log(x) for x in p), rel=1e-6)
    rows = entropy(torch.tensor([[1.0, 0.0], [0.5, 0.5]]))
    torch.testing.assert_close(rows, torch.tensor([0.0, math.log(2)]))


def test_js_distance_zero_for_equal_one_for_disjoint():
    p = torch.tensor([0.2, 0.3, 0.5, 0.0])
    assert float(js_distance(p, p)) == pytest.approx(0.0, abs=1e-3)
    a = torch.tensor([0.5, 0.5, 0.0, 0.0])
    b = torch.tensor([0.0, 0.0, 0.25, 0.75])
    assert float(js_distance(a, b)) == pytest.approx(1.0, abs=1e-6)


def test_js_distance_symmetric_bounded_and_known_value():
    g = torch.Generator().manual_seed(3)
    p = torch.rand(8, 10, generator=g).softmax(-1)
    q = torch.rand(8, 10, generator=g).pow(4).softmax(-1)
    d_pq, d_qp = js_distance(p, q), js_distance(q, p)
    assert d_pq.shape == (8,)
    torch.testing.assert_close(d_pq, d_qp)
    assert bool(((d_pq > 0) & (d_pq < 1)).all())
    # p = [1, 0], q = [0.5, 0.5]: m = [0.75, 0.25], JSD = 1 - 0.75 * log2(3) / 2 in bits
    jsd = 0.5 * math.log2(1 / 0.75) + 0.5 * (0.5 * math.log2(0.5 / 0.75) + 0.5 * math.log2(0.5 / 0.25))
    got = float(js_distance(torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5])))
    assert got == pytest.approx(math.sqrt(jsd), rel=1e-5)


def test_race_noise_is_a_function_of_seed_and_position_only():
    a = race_noise(7, [3, 4, 5], 50)
    assert torch.equal(a, race_noise(7, [3, 4, 5], 50))
    assert torch.equal(a[1:], race_noise(7, [4, 5], 50))  # a row does not depend on its neighbours
    assert not torch.equal(a[0], a[1]) and not torch.equal(a, race_noise(8, [3, 4, 5], 50))
    assert (a > 0).all() and abs(float(a.mean()) - 1.0) < 0.3  # Exp(1) draws


def test_the_race_draws_exactly_from_p():
    """argmax p / E over many seeds follows p (chi-square), zeros included; the negative control,
    argmax p + U with uniform noise, does not."""
    from scipy.stats import chisquare

    p = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    n = 4000
    race = torch.stack([race_scores(p[None], seed, 11)[0].argmax() for seed in range(n)])
    wrong = torch.stack([(p + race_noise(seed, [11], 5)[0] / 10).argmax() for seed in range(n)])
    expected = (p[:4] * n).numpy()
    assert int((race == 4).sum()) == 0
    assert chisquare(torch.bincount(race, minlength=5)[:4].numpy(), expected).pvalue > 1e-3
    wrong_counts = torch.bincount(wrong, minlength=5)[:4].numpy()
    assert chisquare(wrong_counts, expected * wrong_counts.sum() / n).pvalue < 1e-3
