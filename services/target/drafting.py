"""A target session's own drafting (OpenTarget.speculate): a lookup drafter (ngram, retrieval)
drafts each window on the target, between its forwards, under the request's stopping policy,
so that a round needs no round trip to a draft service (docs/services.md, "Drafting on the
target"). A window is drafted by a specd.speculation.proposer.Proposer, as in the in-process
engine and the draft service, with nothing ahead (lookahead 1) and no round trip.

Everything here runs on the service's event loop, between forwards: the verdict of a window
(judged on the compute thread) is kept by `judged` and committed to the proposer, which feeds
it back to the policy, before the next window is drafted."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specd.costs import CostCurve, LoadFit
from specd.drafters.base import Drafter
from specd.errors import InvalidRequest
from specd.grammar import Grammar
from specd.policies import NO_SPECULATION, PolicyResources, check_spec, policy_class, request_policy
from specd.speculation.proposer import Commit, Proposer, Token
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
    def __init__(self, drafter: Drafter, local: LocalSpec, sampling: SamplingParams, prompt: list[int],
                 vocab_size: int, costs):
        """costs(): the cost curve, asked only by a policy that weighs costs (cost-aware)."""
        spec = local.spec
        if spec.policy == NO_SPECULATION:
            raise InvalidRequest("speculate.policy", "drafting needs a stopping policy; 'none' is the target alone")
        check_spec(spec, sampling)
        if policy_class(spec.policy).needs_hidden:
            raise InvalidRequest("speculate.policy", f"{spec.policy} reads a draft model's hidden state; "
                                                     f"the target drafts with {drafter.name}, which has none")
        if local.max_length <= len(prompt):
            raise InvalidRequest("speculate.max_length", f"must exceed the prompt's {len(prompt)} tokens")
        self.policy = request_policy(spec, dict(local.policy_state), PolicyResources(None, None), costs)
        self.session = drafter.open(vocab_size)
        self.max_length = local.max_length
        self.events: list = []  # the proposer's, for the window being drafted
        # Rounds are timed start to start: each commit lands as the next window's drafting starts.
        self.proposer = Proposer(self.session, self.policy, sampling, list(prompt), max_length=local.max_length,
                                 lookahead=1, send_q=False, publish=self.events.append, round_trip=False)
        self.drafts: list[int] = []  # the window being verified
        self.verdict: Verdict | None = None  # its verdict, not yet committed to the proposer
        self.load: tuple[int, int, int] | None = None  # the last forward's other sessions, their tokens, what they emitted
        self.commit_id = 0
        self.grammar_drafted = 0  # drafts the grammar forced (structured output)

    def draft(self, seq: list[int], grammar: Grammar | None = None) -> list[int]:
        """Start a round: the window after the committed tokens seq (seq itself is kept); where
        the session's grammar forces what follows, those tokens, with no drafter call."""
        self.settle()
        p = self.proposer
        p.pace.start()
        cap = min(self.policy.params.max_draft_tokens, self.max_length - len(seq) - 1)
        forced = grammar.forced(cap) if grammar is not None and cap > 0 else []
        if forced:  # drafts with no drafter call and no policy step to observe
            self.grammar_drafted += len(forced)
            self.drafts = forced
            return forced
        while (ready := p.prepare()) is not None:
            window, epoch, after = ready
            t0 = time.perf_counter()
            d = p.next(after)
            p.drafted(window, epoch, after, d, time.perf_counter() - t0)
        self.drafts = [e.token for e in self.events if isinstance(e, Token)]
        self.events.clear()
        return self.drafts

    def judged(self, verdict: Verdict) -> None:
        """The window's verdict (on the compute thread, right after its forward): committed to
        the proposer at the next settle, on the event loop."""
        self.verdict = verdict

    def settle(self) -> None:
        """Commit the last window's verdict, with the load it was verified under: the proposer
        rolls back what it rejected and the policy observes how the window fared."""
        if self.verdict is None:
            return
        v, load = self.verdict, self.load or (None, 0, None)
        self.verdict = self.load = None
        self.commit_id += 1
        self.proposer.commit(Commit(self.commit_id, tuple(self.drafts[:v.num_accepted]) + (v.next_token,),
                                    len(self.drafts), v.num_strict, other_sessions=load[0], other_tokens=load[1],
                                    other_yield=load[2]))
        self.events.clear()  # its Ack: nothing is ahead to acknowledge

    def closed(self) -> Closed:
        """What the session ends with: the policy's state to save, what it drafted."""
        self.settle()
        p = self.proposer
        return Closed(policy_state=self.policy.state(), policy_scale=self.policy.state_scale(),
                      num_drafted=p.num_drafted + self.grammar_drafted, draft_seconds=p.draft_seconds,
                      grammar_drafted=self.grammar_drafted)

    def close(self) -> None:
        self.session.close()


def local_cost_curve(t_draft: float, verify_seconds: list[float], decode_s: float, fit: LoadFit) -> CostCurve:
    """The cost curve a policy drafting on the target weighs: the start-up curve scaled to the
    current decode cost, the batched surface as the target's forwards fit it (LoadFit), and no
    round trip beyond the forward."""
    scale = decode_s / verify_seconds[0] if decode_s > 0 and verify_seconds[0] > 0 else 1.0
    return CostCurve(t_draft, list(range(1, len(verify_seconds) + 1)), [t * scale for t in verify_seconds],
                     batch_seconds=fit.batch_seconds, batch_token_seconds=fit.batch_token_seconds, fit=fit)
