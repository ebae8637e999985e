"""The cost curve: interpolation, the on-disk cache of the start-up measurement, and how it
follows what serving observes (the rules themselves: test_cost_model.py)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from specd import costs
from specd.cost_model import smoothed
from specd.costs import CostCurve, LoadFit, cached_cost_curve, curve_key, interp
from specd.drafters import NgramDrafter


def test_interpolates_inside_and_extrapolates_a_line_beyond():
    curve = CostCurve(0.001, [1, 2, 4], [0.010, 0.020, 0.040])
    assert curve.t_target(3) == pytest.approx(0.030)
    assert curve.t_target(8) == pytest.approx(0.080)  # the least-squares line through the points
    assert curve.round_time(2) == pytest.approx(2 * 0.001 + 0.030)


def test_start_up_measurement_is_cached_per_pair_and_machine(tiny_target, tmp_path, monkeypatch):
    drafter = NgramDrafter()
    first = cached_cost_curve(tiny_target, drafter, tmp_path)
    path = tmp_path / "costs" / f"{curve_key(tiny_target, drafter)}.json"
    assert json.loads(path.read_text())["k"] == list(range(1, 18))

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again although the cache holds the curve")

    monkeypatch.setattr(costs, "measure_cost_curve", no_measuring)
    again = cached_cost_curve(tiny_target, drafter, tmp_path)
    assert again.to_dict() == first.to_dict()
    # another drafter is another pair: its own entry
    assert curve_key(tiny_target, NgramDrafter(max_ngram=3)) != curve_key(tiny_target, drafter)
    path.write_text("{not json")  # a damaged entry is measured anew, not an error
    monkeypatch.undo()
    assert cached_cost_curve(tiny_target, drafter, tmp_path).ks == list(range(1, 18))


def test_the_monotone_curve_irons_out_noisy_medians():
    assert costs.isotonic([5.0, 4.0, 6.0, 9.0, 7.0]).tolist() == [4.5, 4.5, 6.0, 8.0, 8.0]
    curve = CostCurve(0.001, [1, 2, 3, 4], [0.050, 0.060, 0.048, 0.070])
    assert curve.t_monotone(2) == pytest.approx(0.054)  # (0.060 + 0.048) / 2: never below t(1)
    assert curve.t_monotone(3) == curve.t_monotone(2)
    assert curve.t_monotone(6) > curve.t_monotone(4)  # extrapolated with the fitted slope
    curve.scale = 2.0
    assert curve.t_monotone(1) == pytest.approx(0.100)


def test_a_frozen_curve_does_not_move():
    curve = CostCurve(0.0, [1, 2, 4], [0.010, 0.020, 0.040], smoothing=0.0)
    for _ in range(10):
        curve.observe_target(2, 0.040)
        curve.observe_draft(0.003)
    assert curve.t_draft == 0.0 and curve.scale == 1.0
    assert curve.round_time(3) == pytest.approx(0.040)  # t_target(4) as measured


def test_a_live_curve_follows_the_same_rule():
    curve = CostCurve(0.0, [1, 2, 4], [0.010, 0.020, 0.040])
    curve.observe_draft(0.003)  # an unset t_draft takes the first observation
    assert curve.t_draft == 0.003
    curve.observe_target(2, 0.040)  # twice the measured 0.020: the scale moves one step towards 2
    assert curve.scale == pytest.approx(smoothed(1.0, 2.0))
    assert curve.t_target(4) == pytest.approx(0.040 * curve.scale)


class _Deferred:
    """Logits of a device that runs a forward when its result is read back (a GPU's queue)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __getitem__(self, index):
        return self

    def tolist(self):
        import time

        time.sleep(self.seconds)
        return [0.0]


class _DeferredTarget:
    def session(self):
        target = self

        class Session:
            def extend(self, ids, num_logits):
                return _Deferred(target.seconds), None

            def rollback(self, length):
                pass

            def close(self):
                pass
        return Session()

    seconds = 0.02


def test_a_forward_is_timed_until_its_result_exists():
    """A GPU forward returns once queued; the cost curve must time the work, not the queueing
    (it did not once copies to the GPU stopped waiting for the device)."""
    _, ts, _ = costs.measure_t_target(_DeferredTarget(), [5, 6, 7], ks=(1, 3), repeats=3)
    assert min(ts) >= _DeferredTarget.seconds


SURFACE = ([0.03, 0.032, 0.034, 0.036], [0.002, 0.0021, 0.0022, 0.0023])  # 1..4 sessions


def test_the_load_fit_finds_what_forwards_really_cost_against_the_surface():
    """Forwards whose base costs 1.3x the surface and whose further tokens 2.5x: the fit finds
    both, from a mix of batch sizes and window lengths, and a curve prices windows with it."""
    fit = LoadFit(*SURFACE)
    for i in range(300):
        sessions, extra = 1 + i % 4, (i * 7) % 11
        base, per = costs.surface_at(*SURFACE, sessions)
        fit.observe(sessions, sessions + extra, 1.3 * base + 2.5 * per * extra)
    assert fit.a == pytest.approx(1.3, rel=0.05) and fit.b == pytest.approx(2.5, rel=0.05)
    curve = CostCurve(0.0, [1, 2], [0.03, 0.032], batch_seconds=SURFACE[0], batch_token_seconds=SURFACE[1],
                      others=(2.0, 3.0), fit=fit)
    # 3 sessions; one further token from the others, 4 drafts: 1.3 * 0.034 + 2.5 * 5 * 0.0022
    assert curve.loaded_time(4) == pytest.approx(1.3 * 0.034 + 2.5 * 5 * 0.0022, rel=0.06)
    assert curve.loaded_time(4) > CostCurve(0.0, [1, 2], [0.03, 0.032], batch_seconds=SURFACE[0],
                                            batch_token_seconds=SURFACE[1], others=(2.0, 3.0)).loaded_time(4)


def test_plain_forwards_leave_the_token_cost_at_the_surfaces():
    """Forwards of one token per session say nothing about further tokens: b stays at its prior."""
    fit = LoadFit(*SURFACE)
    for i in range(200):
        fit.observe(1 + i % 4, 1 + i % 4, 0.8 * costs.surface_at(*SURFACE, 1 + i % 4)[0])
    assert fit.a == pytest.approx(0.8, rel=0.05) and fit.b == pytest.approx(1.0, abs=0.05)


def test_a_further_token_is_never_priced_below_the_forwards_base():
    """Forwards 1.4x the surface whose few further tokens happen to read 0.3x (noise in the
    fit's smallest share): b is held at a, so a draft is never priced as nearly free."""
    fit = LoadFit(*SURFACE)
    for i in range(300):
        sessions, extra = 1 + i % 4, i % 2
        base, per = costs.surface_at(*SURFACE, sessions)
        fit.observe(sessions, sessions + extra, 1.4 * base + 0.3 * per * extra)
    assert fit.a == pytest.approx(1.4, rel=0.05) and fit.b == fit.a


@pytest.mark.parametrize("others_yield, pays", [(None, True), (3.0, True), (6.0, False)])
def test_a_drafted_token_pays_only_while_it_buys_more_than_it_delays_what_the_others_emit(others_yield, pays):
    """4 sessions: a further token costs 0.0023 s of a 0.036 s forward, so a draft accepted 35% of
    the time pays where the 3 others emit a token each, and not where they emit 6 between them."""
    curve = CostCurve(0.0, [1, 2], [0.03, 0.032], batch_seconds=SURFACE[0], batch_token_seconds=SURFACE[1],
                      others=(3.0, 3.0), others_yield=others_yield)
    assert (curve.loaded_rate(1.35, 1) > curve.loaded_rate(1.0, 0)) == pays


def test_the_others_drafts_that_do_not_pay_never_lower_the_bar_for_this_sessions():
    """13 sessions on the 2-core EPYC's surface (3.8 ms a further token): the 12 others feed 39
    tokens and emit 15, their drafts mostly rejected. Priced as the forward is (173 ms), a first
    draft accepted 60% of the time would pay, and every session's windows grow together; priced
    against the forward of the others' plain steps (70 ms, which emits more per second), it does
    not. Where the others' drafts do pay, the forward as it is stays the reference."""
    ms = 1e-3
    surface = ([(23.5 + 3.9 * i) * ms for i in range(16)], [3.8 * ms] * 16)
    curve = CostCurve(0.0, [1, 2], [0.0235, 0.027], batch_seconds=surface[0], batch_token_seconds=surface[1],
                      others=(12.0, 39.0), others_yield=15.0)
    as_it_is = curve.loaded_time(0), curve.loaded_time(1)
    assert as_it_is[0] == pytest.approx((23.5 + 3.9 * 12 + 27 * 3.8) * ms)
    assert (1.6 + 15) / as_it_is[1] > (1.0 + 15) / as_it_is[0]  # the old price: it would draft
    assert curve.loaded_rate(1.6, 1) < curve.loaded_rate(1.0, 0)
    assert curve.loaded_rate(1.0, 0) == pytest.approx(13 / ((23.5 + 3.9 * 12) * ms))
    paying = CostCurve(0.0, [1, 2], [0.0235, 0.027], batch_seconds=surface[0], batch_token_seconds=surface[1],
                       others=(12.0, 39.0), others_yield=45.0)
    assert paying.loaded_rate(1.0, 0) == pytest.approx(46 / as_it_is[0])


def test_what_the_others_emit_is_followed_like_their_load():
    curve = CostCurve(0.0, [1, 2], [0.03, 0.032], batch_seconds=SURFACE[0], batch_token_seconds=SURFACE[1])
    curve.observe_load(3, 3)
    assert curve.others_yield is None  # unknown: one token each
    curve.observe_load(3, 3, 7)
    assert curve.others_yield == pytest.approx(3 + 0.5 * (7 - 3))


def test_interp_is_numpys_to_the_last_bit():
    """The curve's own interpolation (a plain-Python hot path) gives np.interp's floats exactly:
    at the knots, between them and past both ends."""
    rng = random.Random(0)
    for _ in range(5000):
        xs = sorted(rng.sample(range(1, 40), rng.randint(1, 17)))
        ys = [rng.random() * 0.05 for _ in xs]
        x = rng.choice([rng.uniform(-1, 41), float(rng.randint(0, 41)), float(rng.choice(xs))])
        assert interp(x, xs, ys) == float(np.interp(x, xs, ys))


def test_a_window_size_asked_again_follows_the_scale_as_the_first_time():
    # The curve keeps each size's unscaled time once asked; what it answers must be what a fresh
    # curve with the same scale answers, before and after the scale follows the forwards.
    live = CostCurve(1e-3, [1, 2, 4, 8], [0.020, 0.021, 0.025, 0.031])
    sizes = [1, 3, 8, 12, 0.5, 2.5, 3, 12]
    for observed in (None, 0.040, 0.015, 0.015):
        if observed is not None:
            live.observe_target(3, observed)
        fresh = CostCurve(1e-3, [1, 2, 4, 8], [0.020, 0.021, 0.025, 0.031], scale=live.scale)
        assert [live.t_target(k) for k in sizes] == [fresh.t_target(k) for k in sizes]
    assert live.scale != 1.0


def test_provenance_names_the_commit_the_cpu_and_the_versions():
    import subprocess

    import torch

    from specd.costs import ISA_FLAGS, provenance

    p = provenance()
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert p["commit"] == (head or None) and isinstance(p["dirty"], bool)
    assert p["cpu"] and set(p["cpu_flags"]) <= set(ISA_FLAGS) and p["torch"] == torch.__version__
    assert p["torch_threads"] == torch.get_num_threads() and p["cores"] >= 1 and "transformers" in p
