"""svip: stop when the draft is too uncertain (SVIP, Zhang et al. 2025).

SVIP bounds the rejection probability by the draft entropy and stops once
sqrt(c * H(q)) > h. The paper folds c into h; the authors' code uses c = 0.15, h = 0.3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specd.policies.base import Decision, PolicyParams, StoppingPolicy, bounded
from specd.types import DraftStep


@dataclass(frozen=True)
class SvipParams(PolicyParams):
    max_draft_tokens: int = bounded(40, 1, 256, "hard cap on tokens drafted per round")
    c: float = bounded(0.15, 0.0, 100.0, "entropy scale")
    h: float = bounded(0.3, 0.0, 100.0, "threshold on sqrt(c * H(q))")


class SvipPolicy(StoppingPolicy):
    name = "svip"
    Params = SvipParams
    needs_distribution = True

    def decide(self, step: DraftStep) -> Decision:
        return Decision.STOP if math.sqrt(self.params.c * step.entropy) > self.params.h else Decision.CONTINUE
