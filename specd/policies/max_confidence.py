"""max-confidence: stop when the draft's top probability max q falls below lambda.

Draft & Verify (Zhang et al. 2024) and BiLD (Kim et al. 2023); lambda adapts online with
the rule in threshold.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from specd.policies.base import Decision, PolicyParams, StoppingPolicy, bounded
from specd.policies.threshold import OnlineThreshold
from specd.types import DraftStep, RoundOutcome


@dataclass(frozen=True)
class MaxConfidenceParams(PolicyParams):
    lam0: float = bounded(0.6, 0.0, 1.0, "initial threshold on max q")
    beta1: float = bounded(0.5, 0.0, 1.0, "smoothing of the acceptance rate")
    beta2: float = bounded(0.9, 0.0, 1.0, "smoothing of the threshold")
    eps: float = bounded(0.01, 0.0, 1.0, "threshold step")
    alpha: float = bounded(0.9, 0.0, 1.0, "target acceptance rate")
    adapt: int = bounded(1, 0, 1, "1 adapts the threshold online, 0 keeps it fixed")


class MaxConfidencePolicy(StoppingPolicy):
    name = "max-confidence"
    Params = MaxConfidenceParams
    needs_distribution = True

    def load_state(self, state: dict[str, float]) -> None:
        p = self.params
        self.threshold = OnlineThreshold(state.get("lam", p.lam0), state.get("ar", p.alpha),
                                         p.beta1, p.beta2, p.eps, p.alpha)

    def state(self) -> dict[str, float]:
        return {"lam": self.threshold.lam, "ar": self.threshold.ar}

    def decide(self, step: DraftStep) -> Decision:
        return Decision.STOP if step.max_prob < self.threshold.lam else Decision.CONTINUE

    def observe(self, outcome: RoundOutcome) -> None:
        if self.params.adapt:
            self.threshold.update(outcome)
