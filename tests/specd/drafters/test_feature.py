"""The feature (EAGLE-style) drafter: its session's cached, incremental head outputs equal a
batch forward over the same features, stand-ins are replaced by the target's features when
they arrive, and its file round-trips."""

from __future__ import annotations

import pytest
import torch

from specd.drafters import EarlyExitDrafter, FeatureDrafter
from specd.engine import SpeculativeEngine
from specd.errors import ModelError
from specd.types import SamplingParams, SpecParams


@pytest.fixture(scope="module")
def drafter(tiny_target):
    d = FeatureDrafter(tiny_target)
    torch.manual_seed(0)
    with torch.no_grad():  # a head that is not the identity
        d.head.fc.weight.add_(0.1 * torch.randn_like(d.head.fc.weight))
    return d


def _features(target, seq):
    with torch.no_grad():
        return target.model.get_decoder()(input_ids=torch.tensor([seq])).last_hidden_state[0]


def _logits(d, h):
    with torch.no_grad():
        return d.vocab_logits(h)


def _batch_logits(d, feats, seq):
    """The head over features[0..T-1] and tokens seq[1..T] in one forward: logits at T-1."""
    with torch.no_grad():
        out = d.run(feats[None], torch.tensor([seq[1:feats.shape[0] + 1]]))
    return d.vocab_logits(out[0, -1])


def test_incremental_drafting_equals_a_batch_forward(tiny_target, drafter):
    seq = torch.randint(3, 128, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    f = _features(tiny_target, seq)
    s = drafter.open()
    greedy = SamplingParams()
    s.observe_target(0, f[:8])  # the target verified positions 0..7
    first = s.next(seq[:9], greedy, None, True)
    assert torch.allclose(_logits(drafter, first.hidden), _batch_logits(drafter, f[:8], seq), atol=1e-5)
    # Past the verified prefix the head's own output at position 7 stands in for f_8.
    second = s.next(seq[:10], greedy, None, True)
    stand_in = torch.cat([f[:8], first.hidden[None]])
    assert torch.allclose(_logits(drafter, second.hidden), _batch_logits(drafter, stand_in, seq), atol=1e-5)
    # Verification accepted the draft (seq[:10] stays) and computed f_8, f_9: the position fed
    # with a stand-in is recomputed from the target's feature.
    s.rollback(10)
    s.observe_target(8, f[8:10])
    accepted = s.next(seq[:11], greedy, None, True)
    assert torch.allclose(_logits(drafter, accepted.hidden), _batch_logits(drafter, f[:10], seq), atol=1e-5)
    # Verification rejected it (seq[:9] stays): back to the verified prefix.
    s.rollback(9)
    s.observe_target(8, f[8:9])
    again = s.next(seq[:10], greedy, None, True)
    assert torch.allclose(_logits(drafter, again.hidden), _batch_logits(drafter, f[:9], seq), atol=1e-5)
    assert not torch.allclose(again.hidden, second.hidden)
    assert s.nbytes() > 0
    s.close()
    assert s.nbytes() == 0


def test_nothing_is_drafted_before_the_target_has_spoken(tiny_target, drafter):
    s = drafter.open()
    assert s.next([5, 6, 7], SamplingParams(), None, False) is None
    with pytest.raises(ModelError, match="gap"):
        s.observe_target(3, torch.zeros(1, tiny_target.model.config.hidden_size))


def test_the_engine_drafts_with_it_and_stays_lossless(tiny_target, drafter, hf_greedy):
    engine = SpeculativeEngine(tiny_target, drafter)
    prompt = [5, 9, 17, 33, 5, 9, 17]
    out = engine.generate(prompt, SamplingParams(max_new_tokens=24), SpecParams("constant"))
    assert out.token_ids == hf_greedy(tiny_target.model, prompt, 24)
    assert out.stats.drafted > 0


def test_the_head_file_round_trips_and_is_checked(tiny_target, drafter, tmp_path):
    path = tmp_path / "head.safetensors"
    drafter.set_vocab(torch.arange(0, 64))
    try:
        drafter.save(path, train={"note": "test"})
    finally:
        drafter.set_vocab(None)
    again = FeatureDrafter(tiny_target, path)
    assert again.name.endswith(":feature+head") and again.vocab_ids.numel() == 64
    assert torch.equal(again.head.fc.weight, drafter.head.fc.weight)
    other = tmp_path / "ee.safetensors"
    EarlyExitDrafter(tiny_target, 2).save_adapter(other)
    with pytest.raises(ModelError, match="not a feature head"):
        FeatureDrafter(tiny_target, other)


def test_teacher_forced_logits_are_the_first_draft_after_each_verified_prefix(tiny_target, drafter):
    """What the bench's oracle reads: row i must be what a session drafts after prompt + output[:i]."""
    seq = torch.randint(3, 128, (14,), generator=torch.Generator().manual_seed(2)).tolist()
    f = _features(tiny_target, seq)
    n = 5
    batch = drafter.teacher_forced_logits(seq[:-1], n)  # predictions for seq[-n:]
    for i in range(n):
        p = len(seq) - n + i  # the position of the predicted token
        s = drafter.open()
        s.observe_target(0, f[:p - 1])
        step = s.next(seq[:p], SamplingParams(), None, True)
        assert torch.allclose(_logits(drafter, step.hidden), batch[i], atol=1e-5), i


def test_the_cost_measurement_runs_the_head(tiny_target, drafter, monkeypatch):
    """measure_t_draft must time real draft steps: features first, or the session drafts nothing."""
    from specd.costs import measure_t_draft, synthetic_prefix
    from specd.drafters.feature import FeatureDraftSession

    drafted = []
    real_next = FeatureDraftSession.next

    def counting_next(self, *args, **kwargs):
        token = real_next(self, *args, **kwargs)
        drafted.append(token is not None)
        return token

    monkeypatch.setattr(FeatureDraftSession, "next", counting_next)
    assert measure_t_draft(drafter, synthetic_prefix(tiny_target.vocab_size), repeats=3) > 0
    assert len(drafted) >= 4 and all(drafted)


@pytest.mark.parametrize("verified", [1, 4, 9])
def test_unrolled_depths_are_what_a_session_drafts_past_the_verified_prefix(tiny_target, drafter, verified):
    """Training on stand-ins (specd.training.feature) reads `unrolled`: row t of depth d must be the
    head output a session computes at t when it is the d-th position past the target's features,
    attending to true positions below and its own stand-in chain."""
    seq = torch.randint(3, 128, (14,), generator=torch.Generator().manual_seed(3)).tolist()
    f = _features(tiny_target, seq)
    with torch.no_grad():
        outs = drafter.unrolled(f[None, :-1], torch.tensor([seq[1:]]), 4)
    s = drafter.open()
    s.observe_target(0, f[:verified])  # head positions 0..verified-1 read true features
    for depth in range(1, 5):
        pos = verified - 2 + depth  # the head position that is `depth` past the verified prefix
        if pos + 2 > len(seq):
            break
        step = s.next(seq[:pos + 2], SamplingParams(), None, True)
        assert torch.allclose(step.hidden, outs[depth - 1][0, pos], atol=1e-4), depth  # float drift grows with depth
    # Depth 1 everywhere is the plain forward over true features.
    with torch.no_grad():
        assert torch.allclose(outs[0], drafter.run(f[None, :-1], torch.tensor([seq[1:]])), atol=1e-5)
    # Deeper rows differ from depth 1: the stand-ins are not the target's features.
    assert not torch.allclose(outs[1][0, 5:], outs[0][0, 5:], atol=1e-3)
