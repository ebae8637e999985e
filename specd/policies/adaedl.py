"""adaedl: entropy-based lower bound on acceptance (AdaEDL, Agrawal et al. 2024).

The acceptance probability of the current draft token is bounded below by
1 - sqrt(gamma * H(q)); stop when that bound falls below lambda. lambda adapts online with
the rule in threshold.py (AdaEDL Alg. 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specd.policies.base import Decision, bounded
from specd.policies.threshold import OnlineThresholdParams, OnlineThresholdPolicy
from specd.types import DraftStep


@dataclass(frozen=True)
class AdaEdlParams(OnlineThresholdParams):
    gamma: float = bounded(0.2, 0.0, 100.0, "entropy scale")
    lam0: float = bounded(0.7, 0.0, 1.0, "initial threshold on the acceptance bound")


class AdaEdlPolicy(OnlineThresholdPolicy):
    name = "adaedl"
    Params = AdaEdlParams

    def decide(self, step: DraftStep) -> Decision:
        bound = 1.0 - math.sqrt(self.params.gamma * step.entropy)
        return Decision.STOP if bound < self.threshold.lam else Decision.CONTINUE
