"""`specd bench-services` (specd_bench/services.py): what it measures before its timed runs."""

from __future__ import annotations

from specd_bench.services import _measure_costs
from specd.drafters import NgramDrafter
from specd.engine import SpeculativeEngine


def test_the_cost_curve_is_measured_before_the_timed_runs_where_a_policy_needs_it(tiny_target):
    """Measured on first use, the curve's start-up measurement was timed as part of the first
    cost-aware run (that run read 0.57x of the target alone; warm, 1.04x)."""
    engine = SpeculativeEngine(tiny_target, NgramDrafter())
    _measure_costs(engine, ["constant"], pin=False)
    assert engine._costs is None  # no policy that prices windows: nothing measured
    _measure_costs(engine, ["constant", "cost-aware"], pin=False)
    assert engine._costs is not None
    assert len(engine._costs.t_target_k) == 17
