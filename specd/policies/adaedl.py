"""adaedl: entropy-based lower bound on acceptance (AdaEDL, Agrawal et al. 2024).

The acceptance probability of the current draft token is bounded below by
1 - sqrt(gamma * H(q)); stop when that bound falls below lambda. lambda adapts online with
the rule in threshold.py (AdaEDL Alg. 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specd.policies.base import Decision, PolicyParams, StoppingPolicy, bounded
from specd.policies.threshold import OnlineThreshold
from specd.types import DraftStep, RoundOutcome


@dataclass(frozen=True)
class AdaEdlParams(PolicyParams):
    gamma: float = bounded(0.2, 0.0, 100.0, "entropy scale")
    lam0: float = bounded(0.7, 0.0, 1.0, "initial threshold on the acceptance bound")
    beta1: float = bounded(0.5, 0.0, 1.0, "smoothing of the acceptance rate")
    beta2: float = bounded(0.9, 0.0, 1.0, "smoothing of the threshold")
    eps: float = bounded(0.01, 0.0, 1.0, "threshold step")
    alpha: float = bounded(0.9, 0.0, 1.0, "target acceptance rate")
    adapt: int = bounded(1, 0, 1, "1 adapts the threshold online, 0 keeps it fixed")


class AdaEdlPolicy(StoppingPolicy):
    name = "adaedl"
    Params = AdaEdlParams
    needs_distribution = True

    def load_state(self, state: dict[str, float]) -> None:
        p = self.params
        self.threshold = OnlineThreshold(state.get("lam", p.lam0), state.get("ar", p.alpha),
                                         p.beta1, p.beta2, p.eps, p.alpha)

    def state(self) -> dict[str, float]:
        return {"lam": self.threshold.lam, "ar": self.threshold.ar}

    def decide(self, step: DraftStep) -> Decision:
        bound = 1.0 - math.sqrt(self.params.gamma * step.entropy)
        return Decision.STOP if bound < self.threshold.lam else Decision.CONTINUE

    def observe(self, outcome: RoundOutcome) -> None:
        if self.params.adapt:
            self.threshold.update(outcome)
