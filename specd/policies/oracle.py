"""oracle (analysis only): stop exactly before the first token the target would reject.

Given the target-only continuation, the oracle drops the first draft token that disagrees with
it, so every verified window is fully accepted and nothing is discarded (SpecDec++ Thm 4.1:
N_target = |disagreements| + 1). Greedy decoding, or seeded sampling: coupled draws make the
target's output a function of (prompt, seed), and a draft token is accepted iff it equals the
target's own token there (specd.sampling), so the same rule is exact.
"""

from __future__ import annotations

from specd.errors import InvalidRequest
from specd.policies.base import Decision, PolicyParams, PolicyResources, StoppingPolicy
from specd.types import DraftStep


class OraclePolicy(StoppingPolicy):
    name = "oracle"

    def __init__(self, params: PolicyParams, state: dict[str, float] | None = None,
                 resources: PolicyResources | None = None):
        super().__init__(params, state, resources)
        if self.resources.reference is None:
            raise InvalidRequest("policy", "oracle needs the target-only continuation (analysis only)")
        self.reference = self.resources.reference

    def decide(self, step: DraftStep) -> Decision:
        pos = step.position
        if pos >= len(self.reference) or self.reference[pos] != step.token:
            return Decision.DROP
        return Decision.CONTINUE
