"""The feature hand-off across the services (EAGLE-style drafter, docs/engine.md): the target
returns the hidden states of committed positions, the coordinator passes them to the draft
service, whose feature drafter drafts from them. Greedy output stays the target's; in the
sequential mode the drafts are exactly the in-process engine's, which read the same features."""

from __future__ import annotations

import pytest

from services.coordinator.api import GenerateRequest
from specd.drafters.feature import FeatureDrafter
from specd.engine import SpeculativeEngine
from specd.types import SamplingParams, SpecParams
from tests.services.conftest import draft_service
from tests.services.coordinator.test_coordinator import PROMPTS, generate, reference


class RecordingFeatureDrafter(FeatureDrafter):
    """Logs every proposal: (length of the sequence it followed, token or None)."""

    log: list

    def open(self, vocab_size=None):
        session = super().open(vocab_size)
        propose = session.next

        def next_(seq, *args):
            d = propose(seq, *args)
            self.log.append((len(seq), None if d is None else d.token))
            return d

        session.next = next_
        return session


@pytest.fixture(scope="module")
def feature_drafter(chat_pair):
    drafter = RecordingFeatureDrafter(chat_pair[0])
    drafter.log = []
    return drafter


@pytest.fixture(scope="module")
def feature_service(service_loop, chat_pair, feature_drafter):
    svc = draft_service(service_loop, feature_drafter, chat_pair[0])
    yield svc
    svc.stop()


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "pearl"])
def test_feature_drafter_over_grpc_is_lossless_and_drafts_from_the_targets_features(
        chat_pair, target_service, feature_service, feature_drafter, overlap):
    target, _ = chat_pair
    for prompt in PROMPTS:
        spec = SpecParams("constant", policy_params={"k": 3})
        request = GenerateRequest(prompt=prompt, sampling=SamplingParams(max_new_tokens=32), spec=spec, overlap=overlap)
        feature_drafter.log = []
        ids, finish = generate(target_service.address, feature_service.address, request)
        assert ids == reference(target, prompt, 32)
        stats = finish.spec_stats
        assert not stats["fallback"]
        if len(ids) > 1:  # without the target's features the head proposes nothing
            assert stats["drafted"] > 0
        if not overlap:  # exactly the proposals made in process, from the same features
            served, feature_drafter.log = feature_drafter.log, []
            local = SpeculativeEngine(target, feature_drafter).generate(
                target.encode_prompt(prompt, chat=False), SamplingParams(max_new_tokens=32), spec).stats
            assert served == feature_drafter.log
            assert (stats["drafted"], stats["accepted"]) == (local.drafted, local.accepted)
