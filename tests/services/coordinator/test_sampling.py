"""Sampling through the services follows the target's distribution, with PEARL on.

PEARL adds one path the in-process engine does not have: a draft token drafted past a
verified chunk is kept only if it equals the bonus token the target sampled there. The
first two generated tokens of a tiny model (top-k 6, so 36 possible pairs) are compared
with their exact joint distribution under the target alone (chi-square over seeded
requests); the draft's own samples, the negative control, must fail the same test.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from services.common.settings import TargetSettings
from services.common.state import AsyncMemoryStateStore
from services.coordinator.api import FinishEvent, GenerateRequest
from services.coordinator.coordinator import Coordinator, CoordinatorConfig
from services.target.main import start as start_target
from services.target.servicer import TargetServicer
from specd.drafters import build_drafter
from specd.engine import SpeculativeEngine
from specd.models.tiny import char_tokenizer, loaded, perturbed, tiny_llama
from specd.sampling import logits_to_probs
from specd.types import SamplingParams, SpecParams
from tests.services.conftest import draft_service

RUNS = 1200
PARAMS = SamplingParams(temperature=1.0, top_k=6, max_new_tokens=3)


@pytest.fixture(scope="module")
def pair():
    tok = char_tokenizer()
    target = loaded(tiny_llama(7, layers=2, vocab_size=len(tok), init_range=0.08), "t-sampling", tok)
    draft = loaded(perturbed(target.model, 0.6, seed=2), "d-sampling", tok)
    target.eos_token_ids = draft.eos_token_ids = frozenset()  # every run generates its tokens
    return target, draft


def exact_two_token(model, prompt: list[int]) -> np.ndarray:
    """P(t0, t1) [V, V] of the target alone under PARAMS."""
    with torch.no_grad():
        p0 = logits_to_probs(model(torch.tensor([prompt])).logits[0, -1], PARAMS)
        support = p0.nonzero().flatten().tolist()
        joint = torch.zeros(p0.numel(), p0.numel())
        for t in support:
            p1 = logits_to_probs(model(torch.tensor([prompt + [t]])).logits[0, -1], PARAMS)
            joint[t] = p0[t] * p1
    return joint.numpy()


def pvalue(pairs: Counter, probs: np.ndarray) -> float:
    expected = probs.ravel().astype(np.float64) * sum(pairs.values())
    observed = np.zeros_like(expected)
    for (a, b), n in pairs.items():
        observed[a * probs.shape[1] + b] += n
    if observed[expected == 0].any():
        return 0.0  # a pair the target can never produce
    keep = expected > 0
    exp = expected[keep]
    return chisquare(observed[keep], exp * observed.sum() / exp.sum()).pvalue


def test_pearl_sampling_follows_the_target(service_loop, pair):
    target, draft = pair
    tservicer = TargetServicer(target)
    tserver, tport = service_loop.run(start_target(TargetSettings(port=0), tservicer))
    dsvc = draft_service(service_loop, build_drafter("hf", draft, draft), draft)
    prompt = target.encode_prompt("ab", chat=False)

    async def run() -> tuple[Counter, int, int]:
        coord = Coordinator(CoordinatorConfig(f"127.0.0.1:{tport}", dsvc.address), AsyncMemoryStateStore())
        await coord.connect()
        pairs, kept, rejected = Counter(), 0, 0
        for seed in range(RUNS):
            ids, stats = [], {}
            request = GenerateRequest(prompt_ids=tuple(prompt), spec=SpecParams("constant", max_draft_tokens=2),
                                      sampling=SamplingParams(1.0, 6, 1.0, seed, 3), overlap=True)
            async for ev in coord.generate(request):
                if isinstance(ev, FinishEvent):
                    stats = ev.spec_stats
                else:
                    ids += ev.token_ids
            pairs[tuple(ids[:2])] += 1
            kept += stats["continuations_kept"]
            rejected += stats["drafted"] - stats["accepted"]
        await coord.close()
        return pairs, kept, rejected

    try:
        pairs, kept, rejected = asyncio.run(run())
    finally:
        dsvc.stop()
        service_loop.run(tserver.stop(0))
        service_loop.loop.call_soon_threadsafe(tservicer.close)
    exact = exact_two_token(target.model, prompt)
    assert kept > 0 and rejected > 0  # both the PEARL continuation and the residual paths ran
    assert pvalue(pairs, exact) > 1e-3

    # Negative control: the draft alone (what accepting every draft would emit) must fail.
    own = Counter()
    for seed in range(RUNS):
        out = SpeculativeEngine(draft).generate(prompt, SamplingParams(1.0, 6, 1.0, seed, 2), SpecParams("none"))
        own[tuple(out.token_ids[:2])] += 1
    assert pvalue(own, exact) < 1e-3
