"""Log-probabilities of emitted tokens (specd.logprobs): the target's own at each emitted
position, equal to a plain decoding's whatever drafted the text, one per emitted token."""

from __future__ import annotations

import pytest
import torch

from specd.drafters import HfDrafter, NgramDrafter
from specd.engine import SpeculativeEngine
from specd.errors import InvalidRequest
from specd.types import SamplingParams, SpecParams

PROMPTS = [[5, 9, 17, 33, 5, 9, 17], [77, 3, 77, 3, 77]]
N = 24


def plain_logprobs(model, prompt: list[int], tokens: list[int], vocab: int) -> list[torch.Tensor]:
    """Each emitted position's log-probabilities [vocab], with no cache and no specd code."""
    rows, ids = [], list(prompt)
    with torch.no_grad():
        for t in tokens:
            rows.append(model(torch.tensor([ids])).logits[0, -1, :vocab].float().log_softmax(-1))
            ids.append(t)
    return rows


@pytest.mark.parametrize("drafter", ["none", "hf", "ngram"])
@pytest.mark.parametrize("sampling", [SamplingParams(max_new_tokens=N),
                                      SamplingParams(temperature=0.8, seed=4, max_new_tokens=N, presence_penalty=1.0),
                                      SamplingParams(temperature=1.0, max_new_tokens=N)],
                         ids=["greedy", "seeded-penalized", "unseeded"])
def test_each_emitted_token_has_the_targets_own_logprob(tiny_target, tiny_draft, drafter, sampling):
    d = {"none": None, "hf": HfDrafter(tiny_draft, tiny_target), "ngram": NgramDrafter()}[drafter]
    policy = "none" if d is None else "constant"
    drafted = 0
    for prompt in PROMPTS:
        out = SpeculativeEngine(tiny_target, d).generate(prompt, sampling, SpecParams(policy), logprobs=3)
        assert len(out.logprobs) == len(out.token_ids) > 0
        rows = plain_logprobs(tiny_target.model, prompt, out.token_ids, tiny_target.emitted_vocab)
        for token, lp, row in zip(out.token_ids, out.logprobs, rows):
            assert lp.logprob == pytest.approx(float(row[token]), abs=1e-4)
            top = row.topk(3)
            assert list(lp.top_ids) == top.indices.tolist()
            assert list(lp.top_logprobs) == pytest.approx(top.values.tolist(), abs=1e-4)
        drafted += out.stats.drafted
    assert d is None or drafted > 0


def test_none_asked_none_kept_and_bad_counts_are_refused(tiny_target):
    out = SpeculativeEngine(tiny_target).generate(PROMPTS[0], SamplingParams(max_new_tokens=4), SpecParams("none"))
    assert out.logprobs is None
    for top, spec, field in [(21, SpecParams("none"), "top_logprobs"), (-1, SpecParams("none"), "top_logprobs"),
                             (2, SpecParams("constant", branches=2), "branches")]:
        with pytest.raises(InvalidRequest) as e:
            SpeculativeEngine(tiny_target, NgramDrafter()).generate(PROMPTS[0], SamplingParams(), spec, logprobs=top)
        assert e.value.field == field
