"""Every timing estimate specd keeps, in one table, and the rules they move by.

A process (the target, draft and coordinator services) holds its estimates in one `CostModel`,
made from the rows of TABLE it keeps: its parts (the step batcher, admission, the servicers)
read and feed it by name. A request's own estimates (its cost curve, specd.costs.CostCurve,
and its draft-tree planner, specd.tree.TreePlanner) start afresh with each request and are
read many times per drafted token, so they stay on those objects, but move by their rows here.

The rules:
- AVERAGE: a moving average (`smoothed`): an unset value (0 or None) takes the first
  observation, then each observation moves it by `weight` towards x (count at once weigh
  like count single ones); a weight of 0 freezes it.
- TOWARDS: value + weight * (x - value), from the seed, with no first-observation rule.
- LAST: the last value observed.
- FROZEN: measured (or told) once, at start-up; `seed` sets it, observing it is an error.
- FIT: an online fit (specd.costs.LoadFit) observed with one forward's (sessions, tokens,
  seconds): least squares on relative errors, each older forward weighing LOAD_FIT_FORGET
  times less, pulled towards (1, 1) by a ridge of LOAD_FIT_PRIOR, (a, b) kept in [0.2, 10].

Not here, and not a process's: cost-aware's `paid` and `pace` (specd.policies.cost_aware) are
decayed sums of what one session's drafting realised (tokens, seconds, rounds), kept by the
policy per session and saved with its state across requests. The table lists every timing
estimate of a process and of a request; those two are the policy's own state.
"""

from __future__ import annotations

from dataclasses import dataclass

AVERAGE, TOWARDS, LAST, FROZEN, FIT = "moving average", "towards", "last value", "frozen at start-up", "fit"
SMOOTHING = 0.05  # weight of one observation in every moving average (AVERAGE) of a cost
LOAD_SMOOTHING = 0.5  # weight of one verification's load in a cost curve's `others`
TREE_GAIN_SMOOTHING = 0.1  # weight of each tree round in a planner's gain
TREE_GAIN_PRIOR = 0.05  # tokens one side node adds to a round, before a run has measured its own
LOAD_FIT_FORGET = 0.98  # each older forward weighs this much less in the load fit
LOAD_FIT_PRIOR = 0.1  # the load fit's ridge towards (1, 1), in squared shares of a forward

TARGET, DRAFT, COORDINATOR, REQUEST = "target", "draft", "coordinator", "request"


def smoothed(value: float | None, x: float, count: int = 1, smoothing: float = SMOOTHING) -> float | None:
    """The moving average `value` after `count` observations of x: an unset value (None or <= 0)
    becomes x, else it moves towards x by 1 - (1 - smoothing) ** count, so count observations
    at once weigh like count single ones. A smoothing of 0 freezes the value."""
    if count <= 0 or smoothing <= 0:
        return value
    if value is None or value <= 0:
        return x
    return value + (1.0 - (1.0 - smoothing) ** count) * (x - value)


def decayed(sums, x, forget: float = LOAD_FIT_FORGET):
    """Sums of observations where each older one weighs `forget` times less, after one more (x)."""
    return forget * sums + x


@dataclass(frozen=True)
class Estimate:
    """One row of the table: what is estimated, in what unit, by which rule, and by whom."""
    name: str
    measures: str
    unit: str
    rule: str
    weight: float = 0.0  # AVERAGE and TOWARDS: the weight of one observation
    seed: object = 0.0  # the value before any observation (0: unset, for AVERAGE)
    kept_by: tuple[str, ...] = ()

    def moved(self, value, x, count: int = 1, weight: float | None = None):
        """`value` after `count` observations of x (weight: this holder's own, where it has one)."""
        w = self.weight if weight is None else weight
        if self.rule == AVERAGE:
            return smoothed(value, x, count, w)
        if self.rule == TOWARDS:
            for _ in range(count):
                value = value + w * (x - value)
            return value
        if self.rule == LAST:
            return x
        if self.rule == FIT:
            value.observe(*x)
            return value
        raise ValueError(f"{self.name} is {self.rule}: it is seeded, not observed")

    def describe(self) -> str:
        if self.rule == AVERAGE:
            rule = f"moving average, weight {self.weight} per observation"
        elif self.rule == TOWARDS:
            rule = f"{self.weight} of the way towards each observation, from {self.seed}"
        elif self.rule == FIT:
            rule = f"ridge least squares, each older forward weighing {LOAD_FIT_FORGET}x less"
        else:
            rule = self.rule
        return f"{self.name} [{self.unit}] {rule}; kept by {', '.join(self.kept_by)}: {self.measures}"


TABLE: tuple[Estimate, ...] = (
    # -- kept by a process ---------------------------------------------------------------------
    Estimate("decode_cost", "a one-session, one-token forward (a plain decoding step); on the target seeded "
             "by the start-up verify_seconds[0]", "s", AVERAGE, SMOOTHING, kept_by=(TARGET, DRAFT)),
    Estimate("round_trip", "from a forward's hand-over until the last session it answered is back",
             "s", AVERAGE, SMOOTHING, kept_by=(TARGET, DRAFT)),
    Estimate("token_time", "between a session's replies, per token emitted (latency admission)",
             "s/token", AVERAGE, SMOOTHING, kept_by=(TARGET,)),
    Estimate("local_t_draft", "one draft step of the target's own lookup drafter (0: none)",
             "s/token", FROZEN, kept_by=(TARGET,)),
    Estimate("load_fit", "(a, b): the target's batched forwards against its start-up surface, "
             "T ~ a * base(B) + b * (N - B) * per_token(B)", "ratio", FIT, seed=None, kept_by=(TARGET,)),
    Estimate("verify_seconds", "[n-1]: a one-session forward over n new tokens (the target's cost curve; "
             "the coordinator keeps TargetInfo's)", "s", FROZEN, seed=(), kept_by=(TARGET, COORDINATOR)),
    Estimate("batch_seconds", "[B-1]: a forward of B sessions x 1 token (the batched surface)",
             "s", FROZEN, seed=(), kept_by=(TARGET, COORDINATOR)),
    Estimate("batch_token_seconds", "[B-1]: each further token in that forward",
             "s", FROZEN, seed=(), kept_by=(TARGET, COORDINATOR)),
    Estimate("t_draft", "one draft step of the draft service's drafter; seeded by a start-up measurement",
             "s/token", AVERAGE, SMOOTHING, kept_by=(DRAFT,)),
    Estimate("target_decode_cost", "the target's decode_cost, as its last Verified said (None: not yet)",
             "s", LAST, seed=None, kept_by=(COORDINATOR,)),
    Estimate("round_overhead", "a verification's round trip beyond the target's forward (each round counts once)",
             "s", AVERAGE, SMOOTHING, kept_by=(COORDINATOR,)),
    # -- kept by each request (its CostCurve, its TreePlanner; in process, the engine's) ---------
    Estimate("curve.t_draft", "a drafted token (CostCurve.t_draft); the curve's own smoothing, 0 freezes it",
             "s/token", AVERAGE, SMOOTHING, kept_by=(REQUEST,)),
    Estimate("curve.scale", "observed / measured target forward (CostCurve.scale)",
             "ratio", AVERAGE, SMOOTHING, seed=1.0, kept_by=(REQUEST,)),
    Estimate("curve.others", "(sessions, tokens) of other sessions in the forwards verifying its windows",
             "count", TOWARDS, LOAD_SMOOTHING, seed=0.0, kept_by=(REQUEST,)),
    Estimate("curve.others_yield", "tokens those sessions emit per forward; starts at their count (one each)",
             "tokens", TOWARDS, LOAD_SMOOTHING, seed=None, kept_by=(REQUEST,)),
    Estimate("tree.gain", "tokens one side node of a draft tree added per round (TreePlanner.gain)",
             "tokens", TOWARDS, TREE_GAIN_SMOOTHING, seed=TREE_GAIN_PRIOR, kept_by=(REQUEST,)),
)
ESTIMATES: dict[str, Estimate] = {e.name: e for e in TABLE}


class CostModel:
    """One process's timing estimates (TABLE's rows it keeps), by name."""

    def __init__(self, process: str):
        self.process = process
        self.estimates = {e.name: e for e in TABLE if process in e.kept_by}
        if not self.estimates or process == REQUEST:
            raise ValueError(f"no process {process!r} keeps estimates (a request's stay on its curve and planner)")
        self._values = {name: e.seed for name, e in self.estimates.items()}

    def value(self, name: str):
        return self._values[name]

    def observe(self, name: str, x, count: int = 1) -> None:
        """count observations of x (a FIT: one forward's (sessions, tokens, seconds))."""
        self._values[name] = self.estimates[name].moved(self._values[name], x, count)

    def seed(self, name: str, value) -> None:
        """Set an estimate outright: a start-up measurement, or what another process told."""
        if name not in self.estimates:
            raise KeyError(f"the {self.process} keeps no {name!r}")
        self._values[name] = value

    def __repr__(self) -> str:
        return f"CostModel({self.process!r}, {self._values!r})"
