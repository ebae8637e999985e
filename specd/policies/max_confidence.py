"""max-confidence: stop when the draft's top probability max q falls below lambda.

Draft & Verify (Zhang et al. 2024) and BiLD (Kim et al. 2023); lambda adapts online with
the rule in threshold.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from specd.policies.base import Decision, bounded
from specd.policies.threshold import OnlineThresholdParams, OnlineThresholdPolicy
from specd.types import DraftStep


@dataclass(frozen=True)
class MaxConfidenceParams(OnlineThresholdParams):
    lam0: float = bounded(0.6, 0.0, 1.0, "initial threshold on max q")


class MaxConfidencePolicy(OnlineThresholdPolicy):
    name = "max-confidence"
    Params = MaxConfidenceParams

    def decide(self, step: DraftStep) -> Decision:
        return Decision.STOP if step.max_prob < self.threshold.lam else Decision.CONTINUE
