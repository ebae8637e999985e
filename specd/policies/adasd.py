"""adasd: hyperparameter-free adaptive drafting (AdaSD).

Generation threshold: stop when H(q) exceeds the running mean entropy of the draft tokens
that verification rejected so far (no stop before the first rejection is seen).

Relaxed verification (lossy, opt-in): accept a rejected token when JS(p, q) is below the
midpoint of the running means of JS distance over accepted and over rejected tokens.
"""

from __future__ import annotations

from specd.policies.base import Decision, StoppingPolicy
from specd.types import DraftStep, RoundOutcome


class AdaSdPolicy(StoppingPolicy):
    name = "adasd"
    needs_distribution = True

    def load_state(self, state: dict[str, float]) -> None:
        self.rej_h_sum = state.get("rej_h_sum", 0.0)
        self.rej_n = state.get("rej_n", 0.0)
        self.js_acc_sum = state.get("js_acc_sum", 0.0)
        self.js_acc_n = state.get("js_acc_n", 0.0)
        self.js_rej_sum = state.get("js_rej_sum", 0.0)
        self.js_rej_n = state.get("js_rej_n", 0.0)

    def state(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in
                ("rej_h_sum", "rej_n", "js_acc_sum", "js_acc_n", "js_rej_sum", "js_rej_n")}

    def decide(self, step: DraftStep) -> Decision:
        if self.rej_n and step.entropy > self.rej_h_sum / self.rej_n:
            return Decision.STOP
        return Decision.CONTINUE

    def observe(self, outcome: RoundOutcome) -> None:
        n = outcome.num_accepted
        if n < outcome.num_drafted:  # the first rejected draft token
            self.rej_h_sum += outcome.entropies[n]
            self.rej_n += 1
        if outcome.js_distances:
            self.js_acc_sum += sum(outcome.js_distances[:n])
            self.js_acc_n += n
            if n < len(outcome.js_distances):
                self.js_rej_sum += outcome.js_distances[n]
                self.js_rej_n += 1

    def relaxed_threshold(self) -> float | None:
        if not (self.js_acc_n and self.js_rej_n):
            return None  # strict until both means exist
        return 0.5 * (self.js_acc_sum / self.js_acc_n + self.js_rej_sum / self.js_rej_n)
