"""A target session's own drafting (OpenTarget.speculate): a lookup drafter (ngram, retrieval)
drafts each window on the target, between its forwards, under the request's stopping policy,
so that a round needs no round trip to a draft service (docs/services.md, "Drafting on the
target"). A window is drafted by specd.speculation.round.draft_window, as in the in-process engine.

Everything here runs on the service's event loop, between forwards: the verdict of a window
(judged on the compute thread) is kept by `judged` and observed by the policy before the next
window is drafted."""

from __future__ import annotations

from dataclasses import dataclass, field

from specd.costs import CostCurve, LoadFit
from specd.drafters.base import Drafter
from specd.errors import InvalidRequest
from specd.grammar import Grammar
from specd.policies import NO_SPECULATION, PolicyResources, check_spec, policy_class, request_policy
from specd.speculation.pace import PaceClock
from specd.speculation.round import DraftedWindow, draft_window
from specd.sampling import request_generator
from specd.types import SamplingParams, SpecParams
from specd.verify import Verdict


@dataclass(frozen=True, kw_only=True)
class LocalSpec:
    """How a session drafts on the target (OpenTarget.speculate): its stopping policy, the policy's
    saved state, and the length (prompt included) it drafts up to."""
    spec: SpecParams
    max_length: int
    policy_state: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Closed:
    """What a session ends with: where it drafted here, the policy's state to save and what it
    drafted."""
    policy_state: dict[str, float] = field(default_factory=dict)
    policy_scale: dict[str, float] = field(default_factory=dict)  # StoppingPolicy.state_scale
    num_drafted: int = 0
    draft_seconds: float = 0.0
    grammar_drafted: int = 0  # of the drafts, those the grammar forced


class LocalDrafting:
    def __init__(self, drafter: Drafter, local: LocalSpec, sampling: SamplingParams, prompt_len: int,
                 vocab_size: int, costs):
        """costs(): the cost curve, asked only by a policy that weighs costs (cost-aware)."""
        spec = local.spec
        if spec.policy == NO_SPECULATION:
            raise InvalidRequest("speculate.policy", "drafting needs a stopping policy; 'none' is the target alone")
        check_spec(spec, sampling)
        if policy_class(spec.policy).needs_hidden:
            raise InvalidRequest("speculate.policy", f"{spec.policy} reads a draft model's hidden state; "
                                                     f"the target drafts with {drafter.name}, which has none")
        if local.max_length <= prompt_len:
            raise InvalidRequest("speculate.max_length", f"must exceed the prompt's {prompt_len} tokens")
        self.policy = request_policy(spec, dict(local.policy_state), PolicyResources(None, None), costs)
        self.session = drafter.open(vocab_size)
        self.sampling, self.generator = sampling, request_generator(sampling)
        self.prompt_len, self.max_length = prompt_len, local.max_length
        self.window = DraftedWindow()
        self.verdict: tuple[int, Verdict] | None = None  # (committed before it, the window's verdict), unobserved
        self.load: tuple[int, int, int] | None = None  # the last forward's other sessions, their tokens, what they emitted
        self.pace = PaceClock(self.policy)  # rounds timed start to start (specd.speculation.pace)
        self.emitted = 0  # tokens the last round emitted
        self.num_drafted = 0
        self.grammar_drafted = 0  # of those, drafts the grammar forced (structured output)
        self.draft_seconds = 0.0

    def draft(self, seq: list[int], grammar: Grammar | None = None) -> list[int]:
        """Start a round: the window after the committed tokens seq (seq itself is kept); where
        the session's grammar forces what follows, those tokens, with no drafter call."""
        self.settle()
        self.pace.commit(self.emitted, self.window.ran)  # the last round, from its drafting to now
        self.pace.start()
        cap = min(self.policy.params.max_draft_tokens, self.max_length - len(seq) - 1)
        forced = grammar.forced(cap) if grammar is not None else []
        if forced:  # no policy step to observe: the next settle finds an empty window
            self.window = DraftedWindow()
            self.num_drafted += len(forced)
            self.grammar_drafted += len(forced)
            return forced
        self.window = draft_window(self.policy, self.session, list(seq), self.sampling, self.generator, cap,
                                   len(seq) - self.prompt_len)
        self.num_drafted += len(self.window.tokens)
        self.draft_seconds += self.window.seconds
        return self.window.tokens

    def judged(self, committed: int, verdict: Verdict) -> None:
        """The window's verdict (on the compute thread, right after its forward): observed at the
        next settle, on the event loop."""
        self.verdict = committed, verdict

    def settle(self) -> None:
        """Tell the policy how the last window fared, and the load it was verified under."""
        if self.load is not None and self.policy.resources.costs is not None:
            self.policy.resources.costs.observe_load(*self.load)
            self.load = None
        if self.verdict is None:
            return
        committed, verdict = self.verdict
        self.verdict = None
        outcome = self.window.outcome(verdict.num_strict, verdict.next_token)
        if outcome is not None:
            self.policy.observe(outcome)
        self.session.rollback(committed + verdict.num_accepted)
        self.emitted = verdict.num_accepted + 1

    def closed(self) -> Closed:
        """What the session ends with: the policy's state to save, what it drafted."""
        self.settle()
        return Closed(policy_state=self.policy.state(), policy_scale=self.policy.state_scale(),
                      num_drafted=self.num_drafted,
                      draft_seconds=self.draft_seconds, grammar_drafted=self.grammar_drafted)

    def close(self) -> None:
        self.session.close()


def local_cost_curve(t_draft: float, verify_seconds: list[float], decode_s: float, fit: LoadFit) -> CostCurve:
    """The cost curve a policy drafting on the target weighs: the start-up curve scaled to the
    current decode cost, the batched surface as the target's forwards fit it (LoadFit), and no
    round trip beyond the forward."""
    scale = decode_s / verify_seconds[0] if decode_s > 0 and verify_seconds[0] > 0 else 1.0
    return CostCurve(t_draft, list(range(1, len(verify_seconds) + 1)), [t * scale for t in verify_seconds],
                     batch_seconds=fit.batch_seconds, batch_token_seconds=fit.batch_token_seconds, fit=fit)
