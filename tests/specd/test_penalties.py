"""Penalties and logit_bias (specd.penalties): each row of a window is penalized as the target
alone would penalize that position, and speculation under them is lossless: greedy output is a
plain penalized decoding's, token for token, and seeded output is the target alone's."""

from __future__ import annotations

import pytest
import torch

from specd.drafters import HfDrafter, NgramDrafter
from specd.engine import SpeculativeEngine
from specd.errors import InvalidRequest
from specd.penalties import penalize
from specd.types import SamplingParams, SpecParams

PROMPTS = [[5, 9, 17, 33, 5, 9, 17], [77, 3, 77, 3, 77]]
N = 32
SETTINGS = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.8),
    "repetition": dict(repetition_penalty=1.6),
    "negative": dict(presence_penalty=-1.0, frequency_penalty=-0.5),  # rewards repeats: drafts match more
    "bias": dict(logit_bias=((7, 4.0), (9, -100.0), (17, -100.0))),
    "all": dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3, logit_bias=((3, 2.0),)),
}


def reference_row(row: torch.Tensor, s: SamplingParams, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """One position, written out token by token: the bias, repetition, frequency, presence."""
    x = row.clone().double()
    for token, bias in s.logit_bias:
        x[token] += bias
    if s.repetition_penalty != 1.0:
        for t in set(prompt) | set(generated):
            x[t] = x[t] / s.repetition_penalty if x[t] > 0 else x[t] * s.repetition_penalty
    for t in set(generated):
        x[t] -= s.frequency_penalty * generated.count(t) + s.presence_penalty
    return x.float()


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_each_row_is_penalized_as_its_position_would_be(name):
    torch.manual_seed(0)
    s = SamplingParams(**SETTINGS[name])
    logits = torch.randn(5, 40) * 3
    prompt, generated, drafts = [1, 3, 7], [3, 9, 3, 12], [12, 7, 3, 3, 30]  # the last draft has no row
    out = penalize(logits, s, prompt, generated, drafts)
    for j in range(5):
        torch.testing.assert_close(out[j], reference_row(logits[j], s, prompt, generated + drafts[:j]))
    assert penalize(logits, SamplingParams(), prompt, generated, drafts) is logits  # nothing to apply


def plain_decoding(model, prompt: list[int], s: SamplingParams, n: int, vocab: int) -> list[int]:
    """Greedy decoding with no cache and no specd code: the reference."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            row = model(torch.tensor([ids])).logits[0, -1, :vocab].float()
            ids.append(int(reference_row(row, s, prompt, ids[len(prompt):]).argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("name", sorted(SETTINGS))
@pytest.mark.parametrize("drafter", ["hf", "ngram"])
def test_greedy_speculation_under_penalties_equals_plain_decoding(tiny_target, tiny_draft, name, drafter):
    s = SamplingParams(max_new_tokens=N, **SETTINGS[name])
    d = HfDrafter(tiny_draft, tiny_target) if drafter == "hf" else NgramDrafter()
    drafted = 0
    for prompt in PROMPTS:
        want = plain_decoding(tiny_target.model, prompt, s, N, tiny_target.emitted_vocab)
        out = SpeculativeEngine(tiny_target, d).generate(prompt, s, SpecParams("constant", policy_params={"k": 4}))
        ids = out.token_ids
        assert ids == want[:len(ids)] and (len(ids) == N or ids[-1] in tiny_target.eos_token_ids)
        drafted += out.stats.drafted
    assert drafted > 0


def test_the_penalties_change_the_output(tiny_target):
    """Not a test that cannot fail: every setting above decodes differently from no penalty."""
    base = plain_decoding(tiny_target.model, PROMPTS[0], SamplingParams(), N, tiny_target.emitted_vocab)
    for name, kw in SETTINGS.items():
        assert plain_decoding(tiny_target.model, PROMPTS[0], SamplingParams(**kw), N,
                              tiny_target.emitted_vocab) != base, name


@pytest.mark.parametrize("name", ["all", "frequency"])
def test_seeded_speculation_under_penalties_is_the_target_alones(tiny_target, tiny_draft, name):
    s = SamplingParams(temperature=0.9, seed=11, max_new_tokens=N, **SETTINGS[name])
    for prompt in PROMPTS:
        alone = SpeculativeEngine(tiny_target).generate(prompt, s, SpecParams("none")).token_ids
        for drafter in (HfDrafter(tiny_draft, tiny_target), NgramDrafter()):
            out = SpeculativeEngine(tiny_target, drafter).generate(prompt, s, SpecParams("constant"))
            assert out.token_ids == alone


@pytest.mark.parametrize("kw, field", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias=((3, 101.0),)), "logit_bias"),
    (dict(logit_bias=((10 ** 6, 1.0),)), "logit_bias"),  # past the vocabulary
])
def test_bad_values_name_their_field(tiny_target, kw, field):
    with pytest.raises(InvalidRequest) as e:
        SpeculativeEngine(tiny_target).generate(PROMPTS[0], SamplingParams(**kw), SpecParams("none"))
    assert e.value.field == field


def test_trees_are_refused_under_penalties(tiny_target):
    with pytest.raises(InvalidRequest) as e:
        SpeculativeEngine(tiny_target, NgramDrafter()).generate(
            PROMPTS[0], SamplingParams(presence_penalty=1.0), SpecParams("constant", branches=2))
    assert e.value.field == "branches"
