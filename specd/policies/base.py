"""The stopping-policy interface: after each drafted token, keep drafting or stop.

A policy lives for one request. It is built from its hyperparameters (a frozen dataclass,
overridable per call by name) and the shared adaptive state loaded from the state store;
`state()` returns what must be saved back (docs/engine.md: thresholds and running means
persist across requests, keyed by draft, target, policy and task tag).

The engine enforces the hard cap `max_draft_tokens`; the policy only decides below it.
"""

from __future__ import annotations

import dataclasses
import enum
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from specd.errors import InvalidRequest
from specd.types import DraftStep, RoundOutcome


class Decision(enum.Enum):
    CONTINUE = "continue"  # keep this token and draft another
    STOP = "stop"  # keep this token and verify the window
    DROP = "drop"  # discard this token and verify the window without it (oracle, cost-aware)


def bounded(default: float, lo: float, hi: float, doc: str) -> Any:
    """A hyperparameter field with its inclusive bounds and a one-line meaning."""
    return dataclasses.field(default=default, metadata={"lo": lo, "hi": hi, "doc": doc})


@dataclasses.dataclass(frozen=True)
class PolicyParams:
    """Hyperparameters every policy has."""

    max_draft_tokens: int = bounded(16, 1, 256, "hard cap on tokens drafted per round")

    @classmethod
    def from_overrides(cls, overrides: dict[str, Any], prefix: str = "policy_params") -> "PolicyParams":
        """Defaults updated by name; unknown names and out-of-range values are InvalidRequest."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for name, value in overrides.items():
            f = fields.get(name)
            if f is None:
                raise InvalidRequest(f"{prefix}.{name}",
                                     f"unknown parameter; this policy takes {', '.join(sorted(fields))}")
            values[name] = _check(f, value, f"{prefix}.{name}")
        return cls(**values)


def _check(f: dataclasses.Field, value: Any, where: str) -> Any:
    want_int = isinstance(f.default, int) and not isinstance(f.default, bool)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(where, f"must be a number, got {value!r}")
    lo, hi = f.metadata["lo"], f.metadata["hi"]
    # Compare before converting: this also rejects nan, +-inf and huge ints (JSON allows all three).
    if not lo <= value <= hi:
        raise InvalidRequest(where, f"must be in [{lo}, {hi}], got {value!r}")
    if want_int and value != int(value):
        raise InvalidRequest(where, f"must be an integer, got {value!r}")
    return int(value) if want_int else float(value)


@dataclasses.dataclass(frozen=True)
class PolicyResources:
    """Things a few policies need beyond numbers, provided by whoever runs the engine."""

    reference: tuple[int, ...] | None = None  # oracle: the target-only greedy continuation
    specdecpp_head: Any = None  # specdec++: a loaded AcceptanceHead
    costs: Any = None  # cost-aware: the pair's specd.costs.CostCurve, kept current while serving


class StoppingPolicy(ABC):
    """One decision after each drafted token; feedback after each verification."""

    name: ClassVar[str]
    Params: ClassVar[type[PolicyParams]] = PolicyParams
    needs_hidden: ClassVar[bool] = False  # wants DraftStep.hidden (a learned head)
    needs_distribution: ClassVar[bool] = False  # meaningless with a point-mass drafter (n-gram)
    needs_costs: ClassVar[bool] = False  # wants PolicyResources.costs (the measured cost curve)

    def __init__(self, params: PolicyParams, state: dict[str, float] | None = None,
                 resources: PolicyResources | None = None):
        self.params = params
        self.resources = resources or PolicyResources()
        self.load_state(state or {})

    def load_state(self, state: dict[str, float]) -> None:
        """Restore adaptive state saved by `state()`; stateless policies ignore it."""

    def state(self) -> dict[str, float]:
        """Adaptive state to persist across requests (empty for stateless policies)."""
        return {}

    def state_scale(self) -> dict[str, float]:
        """For the fields of `state()` that are decayed sums: the factor by which this request
        decayed the value it loaded. The store then folds the request's observations into what
        concurrent requests saved (specd.state.StateUpdate). Empty: `state()` is saved whole."""
        return {}

    def begin_round(self) -> None:
        """Called before the first token of each round is drafted."""

    def should_draft(self) -> bool:
        """Asked after begin_round: False skips drafting this round, which is then one plain
        decoding step (a policy that expects drafting not to pay for its cost)."""
        return True

    def plain_rounds(self) -> int:
        """Asked right after should_draft said False: how many rounds, this one included, will
        be plain for certain. The policy is not asked again before they are over (so a draft
        service need not be consulted on each of them); it counts them as asked."""
        return 1

    @abstractmethod
    def decide(self, step: DraftStep) -> Decision:
        """After drafting step.index tokens this round: continue, stop, or drop this token."""

    def observe(self, outcome: RoundOutcome) -> None:
        """Called after verification with what the target accepted."""

    def observe_pace(self, tokens: int, seconds: float, drafted: bool) -> None:
        """A round emitted `tokens` in `seconds` of wall time, measured from the previous
        round's commit to its own; drafted: whether the drafter ran for it (False for a plain
        round that should_draft declined)."""

    def relaxed_threshold(self) -> float | None:
        """JS-distance threshold for lossy relaxed verification (AdaSD only)."""
        return None
