"""cost-aware: keep drafting only while the expected gain is positive (docs/engine.md).

After each drafted token the policy knows
  - a_i, the calibrated probability that draft token i is accepted given that tokens 1..i-1
    were. It is read from a table of feature bins: q(x) in tenths for a model drafter, (match
    length, index in the window, and whether the match is in the request or in a retrieval
    datastore) for the n-gram drafters, each split further by the token's votes (how many of
    the match's occurrences go on with it; specd.drafters.ngram), and under coupled sampling
    by the race noise E(x) the seed drew for the token (specd.sampling). Each split's sparse
    bins start from and shrink towards their parent's estimate. Every bin starts at a prior and is
    recalibrated online from verification outcomes: each judged token (up to and including
    the first rejection) is one observation of its bin, with old observations fading so the
    table follows the traffic. The table is the policy's shared state: requests that run at
    once each fold their own outcomes into it (specd.state.StateUpdate).
  - the cost curve (specd.costs): t_draft, t_target(n) and the per-round overhead, measured
    at start-up and refreshed while serving.

A window of k drafts emits E_k = 1 + sum_{j<=k} prod_{i<=j} a_i tokens on average and costs
C_k = k t_draft + t_target(k + 1) + overhead, so its rate is E_k / C_k. After token k the
policy compares three choices: drop token k (verify k - 1; its draft time is spent either
way), stop (verify k), or continue, valued by the best rate over up to `horizon` more tokens
that are assumed to be accepted like this one. It takes the best. The look-ahead matters on
a CPU, where t_target(n) jumps from 1 to 2 tokens and then flattens, so one more token can
lose while four more win.

This is the expected-throughput form of SpecDec++ Thm 4.3 (stop when P(some drafted token is
rejected) exceeds c2 / (c1 + c2 + overhead)) with the whole measured curve in place of a
constant cost ratio: where verification is nearly flat in n (a GPU) it drafts long windows,
where it is steep (a CPU) short ones, with the same code and no tuning. Dropping is also how it
declines to speculate on one round: a first token it does not believe in is verified as a plain
step. And when the rounds that drafted have, all told, emitted tokens more slowly than plain steps
would have (the drafter's own time is not earned back), it stops drafting altogether, except
for exploring rounds that keep its estimates current: the `explore`-th round after it stopped,
then twice as far apart each time drafting still does not pay (up to EXPLORE_BACKOFF times
`explore`), so a useless drafter costs a request almost nothing.

Whether drafting pays is judged on measured time where there is some (`observe_pace`): the wall
seconds per emitted token of rounds in which the drafter ran against rounds in which it did not.
The cost curve prices each process alone; the clock also sees what the curve cannot, such as a
draft model and the target taking turns on the same cores. While drafting pays and the drafter
is not nearly free, a plain round is run now and then (when the last one has faded from the
measured pace) to keep that comparison current. Until both kinds of round have been timed, the
gate uses the cost curve.

Nearly free means that asking the drafter costs next to nothing beside a plain step: its first
token's draft time and the round's overhead (the round trip between services, which a draft
service's stretch of plain rounds skips: the target runs them back to back). In process an
n-gram lookup is nearly free and is never second-guessed; through the services it is not, and
the clock decides for it as for a model drafter.

Under load a round is asked first whether any window could beat a plain step in the forward it
joins were every draft accepted (`could_pay`); where none could, the drafter is not asked at all.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from specd.errors import InvalidRequest
from specd.policies.base import Decision, PolicyParams, PolicyResources, StoppingPolicy, bounded
from specd.types import DraftStep, RoundOutcome

MAX_MATCH_BIN = 8  # n-gram matches of 8 tokens or more share a bin
MAX_INDEX_BIN = 4  # so do window positions 4 and later
PAYOFF_MARGIN = 0.98  # drafting must realise at least this fraction of the plain step's rate
EXPLORE_BACKOFF = 16  # exploring rounds, while drafting does not pay, space out to this many times `explore`
PACE_MEMORY = 64.0  # about how many recent rounds the measured pace remembers
PACE_MIN_WEIGHT = 0.25  # decayed rounds of each kind (drafter ran / did not) before the pace decides
PROBE_ROUNDS = 2  # a timing probe's plain rounds where a round costs overhead (its first one is not timed)


@dataclass(frozen=True)
class CostAwareParams(PolicyParams):
    horizon: int = bounded(8, 1, 64, "how many further tokens continuing is valued over")
    prior: float = bounded(0.5, 0.0, 1.0, "n-gram bins' acceptance before any outcome (model "
                                          "drafters' bins start at q(x))")
    prior_weight: float = bounded(2.0, 0.0, 1000.0, "pseudo-observations behind each prior")
    memory: float = bounded(500.0, 10.0, 1e6, "about how many recent outcomes each bin remembers")
    explore: int = bounded(16, 1, 1_000_000, "while drafting does not pay, still draft every n-th round "
                                             "to notice when it does again")


@functools.lru_cache(maxsize=1024)
def ngram_bin(match_len: int, index: int, retrieved: bool = False) -> str:
    """n-gram bins: the request's own text ("n") and a retrieval datastore ("r") apart."""
    return f"{'r' if retrieved else 'n'}{min(match_len, MAX_MATCH_BIN)}i{min(index, MAX_INDEX_BIN)}"


def vote_class(votes: int, support: float) -> int:
    """How settled an n-gram token is: 0 most of the occurrences go on differently, 1 a
    majority, 2 the only occurrence, 3 a few agreeing ones, 4 many. The classes split rarely
    accepted tokens from mostly accepted ones (docs/engine.md, "The cost-aware policy")."""
    if support < 0.5:
        return 0
    if support < 1.0:
        return 1
    return 2 if votes <= 1 else 3 if votes <= 5 else 4


NOISE_EDGES = (0.1, 0.3, 0.7, 1.5)  # race-noise classes (Exp(1) draws: 10%, 26%, 50%, 78% quantiles)


def noise_class(noise: float) -> int:
    """How the seeded race favours the token (0: strongly, 4: against it). Coupled sampling
    draws argmax p / E, so a small E(x) makes x a likely winner whatever p(x) is, and acceptance
    falls steeply with E (docs/engine.md, "Seeded sampling")."""
    return sum(noise >= edge for edge in NOISE_EDGES)


def feature_bin(step: DraftStep) -> str:
    """The calibration bin of a drafted token: its drafter's features, then its vote class
    (n-gram drafters), then its race-noise class (coupled sampling), each level a child of the
    one before."""
    if step.match_len > 0:
        key = ngram_bin(step.match_len, step.index, step.retrieved)
        if step.votes > 0:
            key += f"v{vote_class(step.votes, step.support)}"
    else:
        key = f"q{min(int(step.prob * 10), 9)}"
    return key + f"e{noise_class(step.noise)}" if step.noise >= 0 else key


@functools.lru_cache(maxsize=4096)
def parent_bin(bin_: str) -> str | None:
    """A child bin's parent (the same features less the last split): the prior a sparse child
    starts from and shrinks towards; None for a top-level bin."""
    cut = max(bin_.rfind("v"), bin_.rfind("e"))
    return bin_[:cut] if cut > 0 else None


class CostAwarePolicy(StoppingPolicy):
    name = "cost-aware"
    Params = CostAwareParams
    needs_costs = True

    def __init__(self, params: CostAwareParams, state: dict[str, float] | None = None,
                 resources: PolicyResources | None = None):
        super().__init__(params, state, resources)
        if self.resources.costs is None:
            raise InvalidRequest("policy", "cost-aware needs the measured cost curve of this draft/target pair")
        self.costs = self.resources.costs
        self.decay = 1.0 - 1.0 / params.memory
        self.pace_decay = 1.0 - 1.0 / PACE_MEMORY
        self.since_explore = 0  # rounds since drafting last paid or was last explored
        self.backoff = params.explore  # rounds between exploring rounds while drafting does not pay
        self.since_plain = 0  # rounds since the last plain round, while drafting pays
        self.gated = False  # the last round could not pay under the load (could_pay)
        self.begin_round()

    # -- the calibration table (shared state) ------------------------------------------------
    def load_state(self, state: dict[str, float]) -> None:
        self.table: dict[str, list[float]] = {}  # bin -> [accepted weight, rejected weight]
        self._estimates: dict[str, float] = {}  # bin -> estimate, until the table changes
        # What drafting rounds realised: decayed sums of tokens emitted and of their cost.
        self.paid = [float(state.get("rounds:emitted", 0.0)), float(state.get("rounds:seconds", 0.0))]
        # Measured pace, decayed: [tokens, seconds, rounds] of rounds with and without the drafter.
        self.pace = {kind: [float(state.get(f"pace:{kind}_{x}", 0.0)) for x in ("tokens", "seconds", "rounds")]
                     for kind in ("drafted", "plain")}
        for key, value in state.items():
            name, _, kind = key.rpartition(":")
            if name and name != "rounds" and kind in ("a", "r"):
                self.table.setdefault(name, [0.0, 0.0])[kind == "r"] = float(value)
        # The decay this request applied to what it loaded: per bin, and to paid and to pace.
        self.scale: dict[str, float] = {"rounds": 1.0, "pace": 1.0}

    def state(self) -> dict[str, float]:
        out = {"rounds:emitted": self.paid[0], "rounds:seconds": self.paid[1]}
        for kind, sums in self.pace.items():
            for x, value in zip(("tokens", "seconds", "rounds"), sums):
                out[f"pace:{kind}_{x}"] = value
        for name, (acc, rej) in self.table.items():
            out[f"{name}:a"], out[f"{name}:r"] = acc, rej
        return out

    def state_scale(self) -> dict[str, float]:
        """Every field is a decayed sum: concurrent requests' observations add up."""
        return {key: self.scale.get(key.rpartition(":")[0], 1.0) for key in self.state()}

    def estimate(self, bin_: str) -> float:
        """Calibrated P(accepted | the tokens before it in the window were). A child bin's prior
        is its parent's estimate, so a rare vote or noise class starts where its parent stands.
        Kept until the table learns (a window asks for the same bins again and again)."""
        got = self._estimates.get(bin_)
        if got is None:
            got = self._estimates[bin_] = self._estimate(bin_)
        return got

    def _estimate(self, bin_: str) -> float:
        parent = parent_bin(bin_)
        if parent is not None:
            prior = self.estimate(parent)
        elif bin_[0] == "q":
            prior = (int(bin_[1:]) + 0.5) / 10
        else:
            prior = self.params.prior
        acc, rej = self.table.get(bin_, (0.0, 0.0))
        w = self.params.prior_weight
        total = acc + rej + w
        return (acc + w * prior) / total if total > 0 else prior

    def _learn(self, bin_: str, accepted: bool) -> None:
        self._estimates.clear()
        parent = parent_bin(bin_)
        if parent is not None:
            self._learn(parent, accepted)
        counts = self.table.setdefault(bin_, [0.0, 0.0])
        self.scale[bin_] = self.scale.get(bin_, 1.0) * self.decay
        counts[0] *= self.decay
        counts[1] *= self.decay
        counts[not accepted] += 1.0

    # -- decisions ---------------------------------------------------------------------------
    def begin_round(self) -> None:
        self.survive = 1.0  # P(every token drafted so far this round is accepted)
        self.expected = 1.0  # expected tokens emitted by verifying what is drafted so far

    def should_draft(self) -> bool:
        """Draft while drafting pays (`drafting_pays`), with a plain round now and then to keep
        the measured comparison current; while it does not pay, draft only on exploring rounds,
        spaced further apart each time, so the policy notices when drafting pays again. A round
        that no window could pay for (`could_pay`) asks the drafter nothing."""
        self.gated = not self.could_pay()
        if self.gated:
            return False
        if self.drafting_pays():
            self.since_explore, self.backoff = 0, self.params.explore
            self.since_plain += 1
            if self._wants_plain_round():
                self.since_plain = 0
                return False
            return True
        self.since_plain = 0
        self.since_explore += 1
        if self.since_explore >= self.backoff:
            self.since_explore = 0
            self.backoff = min(2 * self.backoff, EXPLORE_BACKOFF * self.params.explore)
            return True
        return False

    def plain_rounds(self) -> int:
        """While drafting does not pay, every round up to the next exploring one is plain. A
        probe while it pays is one round, or PROBE_ROUNDS where a round costs overhead: a
        stretch's first round pays the round trip that the stretch's others skip, and the draft
        service times only the others (services.draft.runner)."""
        if self.gated or self.since_explore == 0:  # the load's next check, or a probe drafting pays for
            return PROBE_ROUNDS if self.costs.overhead > 0 else 1
        rounds = self.backoff - self.since_explore
        self.since_explore += rounds - 1
        return rounds

    def could_pay(self) -> bool:
        """Whether some window could beat a plain step in the forward it joins were every draft
        accepted. Where even that loses (a compute-bound target under load, each further token
        of a forward costing what another session's step does, plus the drafting), no lookup or
        draft step is spent on the round: its tokens could only slow the forward."""
        costs = self.costs
        if not costs.loaded():
            return True
        plain = costs.loaded_rate(1.0, 0)
        most = min(self.params.horizon, self.params.max_draft_tokens)
        return any(costs.loaded_rate(1.0 + k, k) > plain for k in range(1, most + 1))

    def drafting_pays(self) -> bool:
        """Whether the rounds that drafted emitted tokens at least PAYOFF_MARGIN as fast as plain
        steps: on the measured pace when both kinds of round have been timed, else on the cost
        curve (no evidence yet, or a nearly free drafter, counts as paying)."""
        emitted, seconds = self.paid
        if seconds <= 0 or self._nearly_free():
            return True
        measured = self.measured_speedup()
        if measured is not None:
            return measured >= PAYOFF_MARGIN
        return emitted / seconds >= PAYOFF_MARGIN / self.costs.round_time(0)

    def measured_speedup(self) -> float | None:
        """Tokens per second of timed rounds with the drafter over those without; None until
        both have been timed recently enough."""
        (dt, ds, dn), (pt, ps, pn) = self.pace["drafted"], self.pace["plain"]
        if min(dn, pn) < PACE_MIN_WEIGHT or min(ds, ps, pt) <= 0:
            return None
        return (dt / ds) / (pt / ps)

    def _nearly_free(self) -> bool:
        """Asking for a first draft token costs next to nothing: an n-gram lookup in process, not
        where the round also costs overhead a plain stretch would skip."""
        return self.costs.t_draft + self.costs.overhead < (1 - PAYOFF_MARGIN) * self.costs.round_time(0)

    def _wants_plain_round(self) -> bool:
        """A plain round to time, while drafting pays: when the drafter costs real time and the
        last plain round has faded from the measured pace (at most every `explore` rounds)."""
        return (not self._nearly_free() and self.pace["drafted"][2] >= PACE_MIN_WEIGHT
                and self.pace["plain"][2] < PACE_MIN_WEIGHT and self.since_plain >= self.params.explore)

    def observe_pace(self, tokens: int, seconds: float, drafted: bool) -> None:
        for sums in self.pace.values():
            sums[:] = [self.pace_decay * x for x in sums]
        self.scale["pace"] *= self.pace_decay
        sums = self.pace["drafted" if drafted else "plain"]
        sums[0] += tokens
        sums[1] += seconds
        sums[2] += 1.0

    def decide(self, step: DraftStep) -> Decision:
        costs, k = self.costs, step.index
        rate_drop = costs.loaded_rate(self.expected, k - 1, spent=costs.t_draft)  # token k's draft time is spent
        self.survive *= self.estimate(feature_bin(step))
        self.expected += self.survive
        rate_stop = costs.loaded_rate(self.expected, k)
        rate_go = self._continue_rate(step, rate_stop)
        if rate_go > rate_stop and rate_go > rate_drop:
            return Decision.CONTINUE
        return Decision.STOP if rate_stop >= rate_drop else Decision.DROP

    def _continue_rate(self, step: DraftStep, beat: float) -> float:
        """The best rate of drafting 1..horizon more tokens, stopping early once one beats `beat`."""
        costs, k = self.costs, step.index
        survive, expected, best = self.survive, self.expected, 0.0
        for m in range(1, min(self.params.horizon, self.params.max_draft_tokens - k) + 1):
            if step.match_len > 0:  # the match's next token: same match, one position later
                survive *= self.estimate(ngram_bin(step.match_len, k + m, step.retrieved))
            else:  # a model drafter: assume the next tokens are as good as this one
                survive *= self.estimate(feature_bin(step))
            expected += survive
            best = max(best, costs.loaded_rate(expected, k + m))
            if best > beat:
                break
        return best

    def observe(self, outcome: RoundOutcome) -> None:
        n = outcome.num_accepted
        cost = self.costs.round_time(outcome.num_drafted) + (self.costs.t_draft if outcome.dropped else 0.0)
        self.paid = [self.decay * self.paid[0] + n + 1, self.decay * self.paid[1] + cost]
        self.scale["rounds"] *= self.decay
        for i, st in enumerate(outcome.steps[:n + 1]):  # judged: the accepted ones and the first rejection
            self._learn(feature_bin(st), i < n)
        if outcome.dropped is not None and outcome.dropped_accepted is not None:
            self._learn(feature_bin(outcome.dropped), outcome.dropped_accepted)
