"""The cost model's table: each estimate moves as its row says, the holders move theirs by the
table, and nothing in specd/ or services/ keeps a timing by a rule of its own."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from services.target.admission import TargetAdmission
from specd.cost_model import (
    AVERAGE,
    COORDINATOR,
    DRAFT,
    ESTIMATES,
    FIT,
    FROZEN,
    LAST,
    REQUEST,
    SMOOTHING,
    TABLE,
    TARGET,
    TOWARDS,
    CostModel,
    smoothed,
)
from specd.costs import CostCurve, LoadFit
from specd.tree import TreePlanner

PROCESSES = (TARGET, DRAFT, COORDINATOR)
XS = (0.030, 0.040, 0.010, 0.025)
SURFACE = ([0.010, 0.012, 0.014, 0.016], [0.001, 0.0011, 0.0012, 0.0013])


def _by_hand(rule: str, weight: float, seed, xs) -> list:
    """What the declared rule gives after each of xs, computed here and not by the module."""
    value, out = seed, []
    for x in xs:
        if rule == AVERAGE:
            value = x if value is None or value <= 0 else value + weight * (x - value)
        elif rule == TOWARDS:
            value = value + weight * (x - value)
        elif rule == LAST:
            value = x
        out.append(value)
    return out


def test_the_table_names_each_estimate_once_with_a_rule_unit_and_keeper():
    assert len(ESTIMATES) == len(TABLE)
    for e in TABLE:
        assert e.rule in (AVERAGE, TOWARDS, LAST, FROZEN, FIT) and e.unit and e.measures and e.kept_by
        assert set(e.kept_by) <= {*PROCESSES, REQUEST}
        assert REQUEST not in e.kept_by or len(e.kept_by) == 1  # a request's estimate is no process's
        assert e.name in e.describe()
    for process in PROCESSES:
        assert set(CostModel(process).estimates) == {e.name for e in TABLE if process in e.kept_by}
    with pytest.raises(ValueError):
        CostModel(REQUEST)  # kept on each request's curve and planner


@pytest.mark.parametrize("process,name", [(p, e.name) for e in TABLE for p in e.kept_by if p != REQUEST
                                          and e.rule in (AVERAGE, LAST)])
def test_each_process_estimate_moves_as_its_row_says(process, name):
    e, model = ESTIMATES[name], CostModel(process)
    seen = []
    for x in XS:
        model.observe(name, x)
        seen.append(model.value(name))
    assert seen == pytest.approx(_by_hand(e.rule, e.weight, e.seed, XS), rel=1e-12)


@pytest.mark.parametrize("name", [e.name for e in TABLE if e.rule == AVERAGE and REQUEST not in e.kept_by])
def test_a_moving_average_takes_its_seed_then_weighs_counted_observations_like_single_ones(name):
    model = CostModel(ESTIMATES[name].kept_by[0])
    model.seed(name, 0.010)  # a start-up measurement
    model.observe(name, 0.020, count=7)
    assert model.value(name) == pytest.approx(0.020 - 0.010 * (1 - SMOOTHING) ** 7)
    model.observe(name, 1.0, count=0)  # nothing observed: nothing moves
    assert model.value(name) == pytest.approx(0.020 - 0.010 * (1 - SMOOTHING) ** 7)


@pytest.mark.parametrize("unset", [None, 0.0, -1.0])
def test_the_first_observation_replaces_an_unset_average(unset):
    assert smoothed(unset, 0.030) == 0.030
    assert smoothed(0.030, 0.040) == pytest.approx(0.030 + SMOOTHING * 0.010)
    assert smoothed(0.0, 0.5, 3, smoothing=0.0) == 0.0  # a weight of 0 freezes it, even unset
    assert smoothed(0.2, 0.5, 10, smoothing=0.0) == 0.2


@pytest.mark.parametrize("process,name", [(p, e.name) for e in TABLE for p in e.kept_by if e.rule == FROZEN])
def test_a_frozen_estimate_is_seeded_and_never_observed(process, name):
    model = CostModel(process)
    assert model.value(name) == ESTIMATES[name].seed
    model.seed(name, [0.01, 0.02])
    with pytest.raises(ValueError, match="frozen"):
        model.observe(name, 0.5)
    assert model.value(name) == [0.01, 0.02]
    with pytest.raises(KeyError):
        model.seed("no such estimate", 1.0)


def test_the_load_fit_moves_by_its_decayed_least_squares():
    model, fit = CostModel(TARGET), LoadFit(*SURFACE)
    model.seed("load_fit", fit)
    forwards = [(2, 2, 0.024), (4, 12, 0.040), (3, 3, 0.028), (4, 20, 0.060)]
    for f in forwards:
        model.observe("load_fit", f)
    # The same fit, by hand: relative errors, older forwards weighing 0.98x less, ridge 0.1.
    sums = np.zeros(5)
    for sessions, tokens, seconds in forwards:
        base = np.interp(sessions, range(1, 5), SURFACE[0])
        x1, x2 = base, np.interp(sessions, range(1, 5), SURFACE[1]) * (tokens - sessions)
        u, v, z = x1 / (x1 + x2), x2 / (x1 + x2), seconds / (x1 + x2)
        sums = 0.98 * sums + [u * u, u * v, v * v, u * z, v * z]
    uu, uv, vv, uz, vz = sums
    a, b = np.linalg.solve([[uu + 0.1, uv], [uv, vv + 0.1]], [uz + 0.1, vz + 0.1])
    assert model.value("load_fit") is fit and fit.forwards == 4
    a = min(max(a, 0.2), 10)
    assert (fit.a, fit.b) == pytest.approx((a, min(max(b, a), 10)))  # b never below a


def test_the_holders_move_their_estimates_by_the_table():
    """A request's estimates live on its curve and planner; a process's in its cost model."""
    curve = CostCurve(0.0, [1, 2, 4], [0.010, 0.020, 0.040])
    for x in XS:
        curve.observe_draft(x / 10)
        curve.observe_target(2, x)
        curve.observe_load(3, 9, 5)
    row = ESTIMATES
    assert curve.t_draft == pytest.approx(_by_hand(AVERAGE, row["curve.t_draft"].weight, 0.0, [x / 10 for x in XS])[-1])
    assert curve.scale == pytest.approx(_by_hand(AVERAGE, row["curve.scale"].weight, 1.0, [x / 0.020 for x in XS])[-1])
    w = row["curve.others"].weight
    others = (_by_hand(TOWARDS, w, 0.0, [3] * 4)[-1], _by_hand(TOWARDS, w, 0.0, [9] * 4)[-1])
    assert curve.others == pytest.approx(others)
    assert curve.others_yield == pytest.approx(_by_hand(TOWARDS, w, 3, [5] * 4)[-1])  # from one token each

    planner = TreePlanner(3, 4)
    assert planner.gain == row["tree.gain"].seed
    for side, accepted, on_chain in ((4, 3, 2), (2, 2, 2), (5, 4, 1)):
        planner.observe(side, accepted, on_chain)
    gains = [(accepted - on_chain) / side for side, accepted, on_chain in ((4, 3, 2), (2, 2, 2), (5, 4, 1))]
    assert planner.gain == pytest.approx(_by_hand(TOWARDS, row["tree.gain"].weight, row["tree.gain"].seed, gains)[-1])

    costs = CostModel(TARGET)
    admission = TargetAdmission(lambda: None, [0.01], 0.01, costs=costs)
    for x in XS:
        admission.observe_reply(x)
    assert costs.value("token_time") == pytest.approx(_by_hand(AVERAGE, SMOOTHING, 0.0, XS)[-1])


# -- nothing else keeps a timing ---------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]
HAND_WRITTEN = {  # what a timing kept by a rule of its own looks like
    "a MovingAverage": re.compile(r"\bMovingAverage\s*\("),
    "a call of smoothed()": re.compile(r"(?<!def )\bsmoothed\s*\("),
    "v += w * (x - v)": re.compile(r"(?<![\w.])([A-Za-z_][\w.]*)\s*\+=\s*[\w.]+\s*\*\s*\(.*-\s*\1\s*\)"),
    "v + w * (x - v)": re.compile(r"(?<![\w.])([A-Za-z_][\w.]*)\s*\+\s*[\w.]+\s*\*\s*\([^()]*-\s*\1\s*\)"),
    "w * v + (1 - w) * x": re.compile(r"(?<![\w.])([A-Za-z_][\w.]*)\s*\*\s*[\w.\[\]]+\s*\+\s*"
                                      r"\(\s*1(\.0)?\s*-\s*\1\s*\)"),
    "a decayed sum": re.compile(r"(?<![\w.])[\w.]*(decay|forget)\w*\s*\*", re.I),
    "a smoothing constant": re.compile(r"^\s*[\w.]*(smoothing|decay|forget)\w*\s*(:[^=\n]+)?=\s*[\d.]+\s*(#.*)?$",
                                       re.I | re.M),
}
ALLOWED = {  # path -> why it may
    "specd/cost_model.py": "the cost model: every timing's rule is declared there",
    "specd/policies/cost_aware.py": "cost-aware's paid and pace, decayed sums kept by the policy per session "
                                    "(listed in specd.cost_model's docstring)",
    "specd/policies/threshold.py": "the acceptance rate and threshold it follows: not timings",
    "specd/dvi.py": "the training reward's baseline: not a timing",
}


def hand_written(text: str) -> list[str]:
    """What in text keeps an estimate by a rule of its own."""
    return [f"{what}: {m.group(0).strip()}" for what, pattern in HAND_WRITTEN.items() for m in pattern.finditer(text)]


@pytest.mark.parametrize("snippet", [
    "self.decode_cost = MovingAverage()",
    "self.t = smoothed(self.t, x)",
    "self.gain += SMOOTH * ((accepted - on_chain) / side - self.gain)",
    "self.others = (s + a * (other_sessions - s), t)",
    "self.ar = self.beta * self.ar + (1 - self.beta) * x",
    "self._sums = self.forget * self._sums + new",
    "GAIN_SMOOTHING = 0.1",
    "    load_smoothing: float = 0.5  # a weight",
])
def test_the_scan_sees_each_way_of_keeping_a_timing(snippet):
    assert hand_written(snippet)


def test_no_timing_is_kept_outside_the_cost_model():
    found = []
    for top in ("specd", "services"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in ALLOWED or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            found += [f"{rel}: {hit}" for hit in hand_written(path.read_text())]
    assert not found, "timings kept outside specd.cost_model (add a row to its TABLE):\n" + "\n".join(found)
