"""Sampling through the services follows the target's distribution, with PEARL on.

PEARL adds one path the in-process engine does not have: a draft token drafted past a
verified chunk is kept only if it equals the bonus token the target sampled there. The
first two generated tokens of a tiny model (top-k 6, so 36 possible pairs) are compared
with their exact joint distribution under the target alone (chi-square over unseeded
requests, i.e. rejection sampling); the draft's own samples, the negative control, must fail
the same test. Seeded requests are coupled (specd.sampling): through the services, PEARL on,
their output must be exactly the in-process target alone's for the same seed.
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
from specd.runtime.tiny import char_tokenizer, loaded, perturbed, tiny_llama
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


@pytest.fixture(scope="module")
def services(service_loop, pair):
    """The tiny pair behind a real target and draft service: (target address, draft address)."""
    target, draft = pair
    tservicer = TargetServicer(target)
    tserver, tport = service_loop.run(start_target(TargetSettings(port=0), tservicer))
    dsvc = draft_service(service_loop, build_drafter("hf", draft, draft), draft)
    yield f"127.0.0.1:{tport}", dsvc.address
    dsvc.stop()
    service_loop.run(tserver.stop(0))
    service_loop.loop.call_soon_threadsafe(tservicer.close)


def generate_all(addresses, requests) -> list[tuple[list[int], dict]]:
    """Each request through a fresh coordinator: (generated ids, spec_stats)."""
    async def run():
        coord = Coordinator(CoordinatorConfig(*addresses), AsyncMemoryStateStore())
        await coord.connect()
        results = []
        for request in requests:
            ids, stats = [], {}
            async for ev in coord.generate(request):
                if isinstance(ev, FinishEvent):
                    stats = ev.spec_stats
                else:
                    ids += ev.token_ids
            results.append((ids, stats))
        await coord.close()
        return results

    return asyncio.run(run())


@pytest.mark.slow  # a statistical test: thousands of samples
def test_pearl_sampling_follows_the_target(services, pair):
    target, draft = pair
    prompt = target.encode_prompt("ab", chat=False)
    torch.manual_seed(0)
    request = GenerateRequest(prompt_ids=tuple(prompt), spec=SpecParams("constant", max_draft_tokens=2),
                              sampling=SamplingParams(1.0, 6, 1.0, None, 3), overlap=True)
    pairs, kept, rejected = Counter(), 0, 0
    for ids, stats in generate_all(services, [request] * RUNS):
        pairs[tuple(ids[:2])] += 1
        kept += stats["continuations_kept"]
        rejected += stats["drafted"] - stats["accepted"]
    exact = exact_two_token(target.model, prompt)
    assert kept > 0 and rejected > 0  # both the PEARL continuation and the residual paths ran
    assert pvalue(pairs, exact) > 1e-3

    # Negative control: the draft alone (what accepting every draft would emit) must fail.
    own = Counter()
    for seed in range(RUNS):
        out = SpeculativeEngine(draft).generate(prompt, SamplingParams(1.0, 6, 1.0, seed, 2), SpecParams("none"))
        own[tuple(out.token_ids[:2])] += 1
    assert pvalue(own, exact) < 1e-3


def test_seeded_sampling_through_the_services_is_the_target_alones(services, pair):
    """PEARL's overlap makes the windows depend on timing; the seeded output must not."""
    target, _ = pair
    prompt = target.encode_prompt("abcab", chat=False)
    sampling = [SamplingParams(0.8, 0, 0.95, seed, 24) for seed in range(8)]
    requests = [GenerateRequest(prompt_ids=tuple(prompt), spec=SpecParams("heuristic"), sampling=s, overlap=True)
                for s in sampling]
    alone = SpeculativeEngine(target)
    accepted = 0
    for (ids, stats), s in zip(generate_all(services, requests), sampling, strict=True):
        assert ids == alone.generate(prompt, s, SpecParams("none")).token_ids, f"seed {s.seed}"
        accepted += stats["accepted"]
    assert accepted > 0
