"""DVI's pure parts: records and their wire form, the head LoRA, the trainer's schedule and
learning, and the engine logging judged windows and staying lossless with any adapter."""

from __future__ import annotations

import pytest
import torch

from specd.drafters.early_exit import EarlyExitDrafter
from specd.dvi import (
    HeadLoRA,
    MemoryReplayStream,
    Record,
    TrainerConfig,
    judged_records,
    top_logprobs,
    trainer_for,
)
from specd.engine import SpeculativeEngine
from specd.errors import InvalidRequest, ModelError
from specd.types import SamplingParams, SpecParams

H, V = 64, 128


def _record(seed=0, k=4) -> Record:
    g = torch.Generator().manual_seed(seed)
    lp, ids = top_logprobs(torch.randn(1, V, generator=g), k)
    return Record(torch.randn(H, generator=g), 7, 1.0, ids[0], lp[0], version=3)


def test_record_round_trips_through_its_wire_form():
    r = _record()
    back = Record.decode({k.encode(): v for k, v in r.encode().items()})  # Redis returns bytes keys
    assert torch.allclose(back.hidden, r.hidden, atol=1e-2)  # float16 on the wire
    assert (back.token, back.reward, back.version) == (7, 1.0, 3)
    assert torch.equal(back.top_ids, r.top_ids) and torch.equal(back.top_logprobs, r.top_logprobs)


def test_a_malformed_record_is_refused():
    fields = _record().encode()
    with pytest.raises(ValueError, match="malformed"):
        Record.decode({k: v for k, v in fields.items() if k != "h"})
    with pytest.raises(ValueError, match="log-probs"):
        Record.decode({**fields, "l": fields["l"][:4]})


def test_top_logprobs_are_the_largest_normalised_ones():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    lp, ids = top_logprobs(logits, 2)
    assert ids.tolist() == [[1, 3]]
    assert torch.allclose(lp, logits.log_softmax(-1)[:, [1, 3]])


def test_judged_records_stop_at_the_first_rejection():
    hs = [torch.full((H,), float(i)) for i in range(4)]
    logits = torch.randn(5, V)
    recs = judged_records(hs, [10, 11, 12, 13], num_strict=2, target_logits=logits)
    assert [(r.token, r.reward) for r in recs] == [(10, 1.0), (11, 1.0), (12, 0.0)]
    assert torch.equal(recs[2].top_ids, logits[2].topk(16).indices)
    all_ok = judged_records(hs, [10, 11, 12, 13], num_strict=4, target_logits=logits)
    assert [r.reward for r in all_ok] == [1.0] * 4  # the bonus position has no draft: not logged
    assert judged_records([None] * 4, [1, 2, 3, 4], 1, logits) == []


def test_lora_round_trips_and_starts_as_no_change():
    lora = HeadLoRA(H, V, rank=4, version=9)
    h = torch.randn(3, H)
    assert torch.count_nonzero(lora(h)) == 0  # B starts at zero
    with torch.no_grad():
        lora.B.normal_()
    back = HeadLoRA.from_bytes(lora.to_bytes())
    assert back.version == 9 and torch.allclose(back(h), lora(h))
    with pytest.raises(ModelError, match="not a DVI LoRA"):
        HeadLoRA.from_bytes(b"garbage-bytes-here")


def _teacher(seed=0):
    """A head W the drafter starts from and a 'target' head it should learn, W plus a rank-4
    change (what a LoRA can represent)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(V, H, generator=g) / H ** 0.5
    target = W + torch.randn(V, 4, generator=g) @ torch.randn(4, H, generator=g) / H ** 0.5
    return W, target


def _records(target_W, n, seed, W=None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        h = torch.randn(H, generator=g) * 3
        lp, ids = top_logprobs((target_W @ h)[None], 16)
        x = int((W @ h).argmax()) if W is not None else int(ids[0, 0])
        out.append(Record(h, x, float(x == int(ids[0, 0])), ids[0], lp[0]))
    return out


def _agreement(trainer, records):
    with torch.no_grad():
        h = torch.stack([r.hidden for r in records])
        pred = (h @ trainer.W.T + trainer.lora(h)).argmax(-1)
    return float((pred == torch.stack([r.top_ids[0] for r in records])).float().mean())


def _trainer(W, **cfg):
    from specd.dvi import DVITrainer

    return DVITrainer(W, None, V, TrainerConfig(**cfg))


def test_trainer_learns_the_target_from_replay_records():
    W, target = _teacher()
    trainer = _trainer(W, rank=16, lr=5e-3, kl_steps=50, seed=0)
    held_out = _records(target, 300, seed=99)
    before = _agreement(trainer, held_out)
    trainer.add(_records(target, 1000, seed=1, W=W))
    for _ in range(400):
        trainer.step()
    after = _agreement(trainer, held_out)
    assert after > before + 0.15, (before, after)


def test_the_schedule_is_kl_first_then_kl_with_rl_terms():
    W, target = _teacher()
    trainer = _trainer(W, kl_steps=3, batch_size=8)
    trainer.add(_records(target, 20, seed=1, W=W))
    stats = [trainer.step() for _ in range(5)]
    assert all("ce" not in s for s in stats[:3])
    assert all({"ce", "pg", "kl"} <= s.keys() for s in stats[3:])
    assert trainer.version == 5 and trainer.snapshot().version == 5


def test_top_k_outside_a_reduced_vocabulary_is_renormalised_not_nan():
    W, _ = _teacher()
    from specd.dvi import DVITrainer

    keep = torch.arange(0, V, 2)  # even ids only
    trainer = DVITrainer(W[keep], keep, V, TrainerConfig(batch_size=4))
    odd = Record(torch.randn(H), 2, 0.0, torch.tensor([1, 3, 5]), torch.tensor([-0.1, -2.0, -3.0]))
    mixed = Record(torch.randn(H), 4, 1.0, torch.tensor([3, 4, 6]), torch.tensor([-0.1, -2.0, -3.0]))
    trainer.add([odd, mixed])
    s = trainer.step()
    assert all(torch.isfinite(torch.tensor(v)) for v in s.values())
    assert all(torch.isfinite(p).all() for p in trainer.lora.parameters())


def test_records_of_another_hidden_size_are_refused():
    W, _ = _teacher()
    trainer = _trainer(W)
    with pytest.raises(ValueError, match="hidden size"):
        trainer.add([Record(torch.randn(H + 1), 1, 1.0, torch.tensor([1]), torch.tensor([0.0]))])


def test_checkpoint_resumes_the_same_training():
    W, target = _teacher()
    recs = _records(target, 64, seed=1, W=W)
    a, b = _trainer(W, batch_size=64, seed=0), _trainer(W, batch_size=64, seed=0)
    a.add(recs)
    b.add(recs)
    for _ in range(3):
        a.step()
    b.restore(a.checkpoint())
    a.step()
    b.step()
    assert b.steps == a.steps == 4
    assert torch.allclose(a.lora.B, b.lora.B) and torch.allclose(a.lora.A, b.lora.A)


def test_config_errors_name_the_field():
    with pytest.raises(InvalidRequest, match="lr"):
        TrainerConfig(lr=0).validate()
    with pytest.raises(InvalidRequest, match="batch_size"):
        TrainerConfig(batch_size=0).validate()


# -- the drafter and the engine ------------------------------------------------------------
@pytest.fixture(scope="module")
def drafter(tiny_target):
    return EarlyExitDrafter(tiny_target, layers=1)


def _strong_lora(d, seed):
    torch.manual_seed(seed)
    rows, hidden = d.head_weight.shape
    lora = HeadLoRA(hidden, rows, rank=4, version=seed)
    with torch.no_grad():
        lora.B.normal_(0, 3.0)
    return lora


def test_set_lora_changes_the_drafts_and_refuses_a_misfit(drafter, tiny_target):
    h = torch.randn(2, drafter.head_weight.shape[1])
    plain = drafter.vocab_logits(h)
    drafter.set_lora(_strong_lora(drafter, 1))
    try:
        assert drafter.lora_version == 1 and not torch.allclose(drafter.vocab_logits(h), plain)
        with pytest.raises(ModelError, match="rows"):
            drafter.set_lora(HeadLoRA(h.shape[1], 5))
    finally:
        drafter.set_lora(None)
    assert torch.equal(drafter.vocab_logits(h), plain) and drafter.lora_version == 0


def test_engine_logs_judged_windows_and_stays_lossless_while_adapters_change(drafter, tiny_target):
    replay = MemoryReplayStream()
    engine = SpeculativeEngine(tiny_target, drafter, replay=replay)
    alone = SpeculativeEngine(tiny_target)
    sampling = SamplingParams(max_new_tokens=40)
    try:
        for i, seed in enumerate([0, 5, 6]):
            drafter.set_lora(_strong_lora(drafter, seed) if seed else None)
            prompt = [5 + i, 17, 33, 9, 70]
            before = len(replay)
            run = engine.start(prompt, sampling, SpecParams("constant", policy_params={"k": 3}))
            for j, _ in enumerate(run):
                if j == 3:  # a hot swap in the middle of a request
                    drafter.set_lora(_strong_lora(drafter, seed + 100))
            run.close()
            out = run.result()
            assert out.token_ids == alone.generate(prompt, sampling, SpecParams("none")).token_ids
            s = out.stats
            judged = sum(min(n + 1, k) for k, n in zip(s.draft_lengths, s.accepted_lengths))
            recs = [r for _, r in replay.read(0, 1 << 20)][before:]
            assert len(recs) == judged and sum(r.reward for r in recs) == s.accepted
    finally:
        drafter.set_lora(None)


def test_online_learning_needs_a_learning_drafter(tiny_target):
    from specd.drafters import build_drafter

    with pytest.raises(InvalidRequest, match="early-exit or feature"):
        SpeculativeEngine(tiny_target, build_drafter("ngram", None), replay=MemoryReplayStream())
    with pytest.raises(InvalidRequest, match="drafter"):
        trainer_for(build_drafter("ngram", None))
