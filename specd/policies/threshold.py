"""The online threshold update shared by max-confidence and AdaEDL.

Draft & Verify (Zhang et al. 2024) §3.3 and AdaEDL (Agrawal et al. 2024) Alg. 1: track the
acceptance rate AR with an exponential moving average and nudge the stopping threshold
lambda up when acceptance is low (stop earlier) and down when it is high and drafting was
cut short by the threshold (draft longer):

    AR  <- b1 * AR + (1 - b1) * accepted / drafted
    lam' = lam + eps            if AR < alpha
         = lam - eps            elif the round stopped before the cap
         = lam                  otherwise
    lam <- b2 * lam + (1 - b2) * lam'
"""

from __future__ import annotations

from dataclasses import dataclass

from specd.policies.base import PolicyParams, StoppingPolicy, bounded
from specd.types import RoundOutcome


@dataclass
class OnlineThreshold:
    lam: float
    ar: float  # smoothed acceptance rate; starts at alpha (no evidence either way)
    beta1: float = 0.5
    beta2: float = 0.9
    eps: float = 0.01
    alpha: float = 0.9

    def update(self, outcome: RoundOutcome) -> None:
        if outcome.num_drafted == 0:
            return
        self.ar = self.beta1 * self.ar + (1 - self.beta1) * outcome.num_accepted / outcome.num_drafted
        if self.ar < self.alpha:
            target = self.lam + self.eps
        elif not outcome.hit_cap:
            target = self.lam - self.eps
        else:
            target = self.lam
        self.lam = min(1.0, max(0.0, self.beta2 * self.lam + (1 - self.beta2) * target))


@dataclass(frozen=True)
class OnlineThresholdParams(PolicyParams):
    lam0: float = bounded(0.5, 0.0, 1.0, "initial threshold")
    beta1: float = bounded(0.5, 0.0, 1.0, "smoothing of the acceptance rate")
    beta2: float = bounded(0.9, 0.0, 1.0, "smoothing of the threshold")
    eps: float = bounded(0.01, 0.0, 1.0, "threshold step")
    alpha: float = bounded(0.9, 0.0, 1.0, "target acceptance rate")
    adapt: int = bounded(1, 0, 1, "1 adapts the threshold online, 0 keeps it fixed")


class OnlineThresholdPolicy(StoppingPolicy):
    """A policy that stops when a per-token score falls below an online-adapted lambda."""

    Params = OnlineThresholdParams
    needs_distribution = True

    def load_state(self, state: dict[str, float]) -> None:
        p = self.params
        self.threshold = OnlineThreshold(state.get("lam", p.lam0), state.get("ar", p.alpha),
                                         p.beta1, p.beta2, p.eps, p.alpha)

    def state(self) -> dict[str, float]:
        return {"lam": self.threshold.lam, "ar": self.threshold.ar}

    def observe(self, outcome: RoundOutcome) -> None:
        if self.params.adapt:
            self.threshold.update(outcome)
