"""The virtual device (specd.runtime.virtual): a pooled forward returns no sooner than its
profile's time for its shape, sleeping (not spinning) while it waits; profiles are read from
bench-load's results and priced by shape; a target without a KV pool refuses one."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import torch

from specd.errors import InvalidRequest
from specd.runtime.pool import pooled_extend
from specd.runtime.virtual import WINDOW_TOKENS, DeviceProfile, Replay, VirtualDevice

COSTS = {"batch_s": [0.04, 0.05, 0.06], "batch_token_s": [0.002, 0.003, 0.004], "verify_s": [0.04, 0.05, 0.09]}


def test_a_profile_prices_a_forward_by_its_sessions_and_tokens(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"machine": "a GPU", "target_costs": COSTS}))
    p = DeviceProfile.load(path)
    assert p.name == "a GPU"
    assert p.seconds([1]) == pytest.approx(0.04)
    assert p.seconds([3, 1]) == pytest.approx(0.05 + 2 * 0.003)  # two sessions; one brings 2 more tokens
    assert p.seconds([1] * 5) == pytest.approx(0.06 + 2 * 0.01)  # past the surface: along its last two points
    prefill = (0.09 - 0.04) / 2
    assert p.seconds([WINDOW_TOKENS + 11]) == pytest.approx(0.04 + WINDOW_TOKENS * 0.002 + 10 * prefill)
    (tmp_path / "bare.json").write_text(json.dumps(COSTS))  # the lists alone are a profile too
    assert DeviceProfile.load(tmp_path / "bare.json").batch_s == (0.04, 0.05, 0.06)


@pytest.mark.parametrize("doc", ["not json", {"target_costs": None}, {**COSTS, "batch_token_s": [0.1]},
                                 {**COSTS, "verify_s": [0.1]}, {**COSTS, "batch_s": [-1, 0, 0]}])
def test_a_bad_profile_names_the_setting(tmp_path, doc):
    path = tmp_path / "p.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(InvalidRequest) as e:
        DeviceProfile.load(path)
    assert e.value.field == "virtual_device"
    with pytest.raises(InvalidRequest):
        DeviceProfile.load(tmp_path / "missing.json")


def test_a_pooled_forward_takes_the_profiles_time_sleeping_out_the_rest(tiny_target):
    """The wait is a sleep (the GIL released, no CPU spent), not a spin: the calling thread's CPU
    time stays that of the forward itself."""
    model = replace(tiny_target, forward="lean")
    pool = model.use_pool(2, 64)
    warm = model.session()
    pooled_extend([warm], [[1]], [1])
    warm.close()
    profile = DeviceProfile((0.4, 0.5), (0.01, 0.01), (0.4, 0.41))
    pool.virtual = VirtualDevice(profile)
    a, b = model.session(), model.session()
    try:
        wall, cpu = time.perf_counter(), time.thread_time()
        pooled_extend([a, b], [[3, 4, 5], [6]], [1, 1])
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    finally:
        a.close(), b.close()
    assert wall >= profile.seconds([3, 1]) == pytest.approx(0.52)
    assert cpu < 0.5 * wall
    assert pool.virtual.forwards == 1 and pool.virtual.waited_s > 0.2


def test_a_target_without_a_kv_pool_refuses_a_virtual_device(tmp_path, tiny_dirs):
    from services.common.settings import TargetSettings
    from services.target.main import load_target

    path = tmp_path / "p.json"
    path.write_text(json.dumps(COSTS))
    with pytest.raises(InvalidRequest) as e:
        load_target(TargetSettings(model=str(tiny_dirs[0]), kv_slots=0, virtual_device=path))
    assert e.value.field == "virtual_device"
    target = load_target(TargetSettings(model=str(tiny_dirs[0]), kv_slots=2, virtual_device=path))
    assert target.pool.virtual.profile.batch_s == (0.04, 0.05, 0.06)


def _replayed(tiny_target, sequences):
    model = replace(tiny_target, forward="lean")
    pool = model.use_pool(3, 64)
    pool.virtual = VirtualDevice(DeviceProfile((0.0,), (0.0,), (0.0, 0.0)), Replay(sequences))
    return model, pool


def test_a_replay_puts_the_recorded_answer_first_and_leaves_other_contexts_the_models(tiny_target):
    prompt, answer = [5, 9, 17, 33, 8], [40, 41, 7, 90, 13, 2]
    own = replace(tiny_target, forward="lean")
    own.use_pool(1, 64)
    reference = own.session()
    wrong = 77
    try:
        expected = pooled_extend([reference], [prompt + answer[:3] + [wrong]], [5])[0][0]
    finally:
        reference.close()
    model, pool = _replayed(tiny_target, [(prompt, answer)])
    s = model.session()
    try:
        first = pooled_extend([s], [prompt], [1])[0][0]
        assert first.argmax(-1).tolist() == [answer[0]]
        # a window of three right drafts and a wrong one: rows up to the wrong one replayed
        window = pooled_extend([s], [answer[:3] + [wrong]], [4])[0][0]
        assert window[:3].argmax(-1).tolist() == answer[1:4]
        assert torch.allclose(window[3], expected[4], atol=1e-4)  # after the wrong draft: the model's own row
        assert pool.virtual.replay.replayed == 4 and pool.virtual.replay.own == 1
        s.rollback(len(prompt) + 3)  # the wrong draft rejected: the same position replays again
        assert pooled_extend([s], [[answer[3]]], [1])[0][0].argmax(-1).tolist() == [answer[4]]
        other = model.session()  # a copied prefix carries its tokens
        try:
            assert other.copy_from(s, len(prompt) + 4)
            assert pooled_extend([other], [[answer[4]]], [1])[0][0].argmax(-1).tolist() == [answer[5]]
        finally:
            other.close()
    finally:
        s.close()


def test_decoding_on_a_replay_gives_the_recorded_answer_and_speculation_keeps_it(tiny_target):
    """The engine on a replayed pool answers with the recorded tokens, and a lookup drafter's
    rounds over that (repetitive) answer keep drafts and change nothing."""
    from specd.drafters import build_drafter
    from specd.engine import SpeculativeEngine
    from specd.types import SamplingParams, SpecParams

    prompt = [5, 9, 17, 33, 8]
    answer = [40, 41, 7, 90, 13, 40, 41, 7, 90, 13, 40, 41, 7, 90, 13, 40, 41, 7, 90, 2]
    model, _ = _replayed(tiny_target, [(prompt, answer)])
    sampling = SamplingParams(max_new_tokens=30)
    alone = SpeculativeEngine(model).generate(prompt, sampling, SpecParams("none"))
    assert alone.token_ids == answer
    drafted = SpeculativeEngine(model, build_drafter("ngram", model)).generate(prompt, sampling, SpecParams("constant"))
    assert drafted.token_ids == answer and drafted.stats.accepted > 0


def test_a_replay_is_refused_without_a_virtual_device_or_a_recording(tmp_path, tiny_dirs):
    from services.common.settings import TargetSettings
    from services.target.main import load_target

    profile, answers = tmp_path / "p.json", tmp_path / "answers.json"
    profile.write_text(json.dumps(COSTS))
    answers.write_text(json.dumps({"prompts": [[5, 6]], "greedy": [[7, 2]]}))
    with pytest.raises(InvalidRequest) as e:
        load_target(TargetSettings(model=str(tiny_dirs[0]), kv_slots=2, virtual_replay=answers))
    assert e.value.field == "virtual_replay"
    (tmp_path / "bad.json").write_text(json.dumps({"greedy": [[7, 2]]}))
    with pytest.raises(InvalidRequest) as e:
        load_target(TargetSettings(model=str(tiny_dirs[0]), kv_slots=2, virtual_device=profile,
                                   virtual_replay=tmp_path / "bad.json"))
    assert e.value.field == "virtual_replay"
    target = load_target(TargetSettings(model=str(tiny_dirs[0]), kv_slots=2, virtual_device=profile,
                                        virtual_replay=answers))
    assert target.pool.virtual.replay.next == {(1, (5, 6)): 7, (2, (5, 6, 7)): 2}
