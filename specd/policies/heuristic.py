"""heuristic: transformers' assisted-generation schedule.

K grows by 2 after a round in which every draft token was accepted and shrinks by 1
(never below 1) otherwise; K is shared adaptive state.
"""

from __future__ import annotations

from dataclasses import dataclass

from specd.policies.base import Decision, PolicyParams, StoppingPolicy, bounded
from specd.types import DraftStep, RoundOutcome


@dataclass(frozen=True)
class HeuristicParams(PolicyParams):
    k0: int = bounded(5, 1, 256, "initial draft length")


class HeuristicPolicy(StoppingPolicy):
    name = "heuristic"
    Params = HeuristicParams

    def load_state(self, state: dict[str, float]) -> None:
        self.k = int(state.get("k", self.params.k0))

    def state(self) -> dict[str, float]:
        return {"k": float(self.k)}

    def decide(self, step: DraftStep) -> Decision:
        return Decision.STOP if step.index >= self.k else Decision.CONTINUE

    def observe(self, outcome: RoundOutcome) -> None:
        if outcome.num_drafted == 0:
            return
        self.k = min(self.k + 2, self.params.max_draft_tokens) if outcome.all_accepted else max(1, self.k - 1)
