"""constant: draft exactly K tokens per round (Leviathan et al. 2023)."""

from __future__ import annotations

from dataclasses import dataclass

from specd.policies.base import Decision, PolicyParams, StoppingPolicy, bounded
from specd.types import DraftStep


@dataclass(frozen=True)
class ConstantParams(PolicyParams):
    k: int = bounded(5, 1, 256, "tokens drafted per round")


class ConstantPolicy(StoppingPolicy):
    name = "constant"
    Params = ConstantParams

    def decide(self, step: DraftStep) -> Decision:
        return Decision.STOP if step.index >= self.params.k else Decision.CONTINUE
