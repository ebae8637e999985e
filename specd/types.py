"""Small domain types shared by the engine, drafters and policies.

Glossary (used the same way everywhere in specd):
- *committed* tokens: prompt + tokens already emitted; never change again.
- *draft* tokens: proposed by the drafter after the committed ones, not yet verified.
- *accepted* tokens: the leading draft tokens that verification kept.
- *recovered* token: the token the target emits at the first rejected position.
- *bonus* token: the token the target emits after a window whose drafts were all accepted.
- a *window*: the draft tokens one verification judges (k = 0: a plain decoding step); a draft
  *tree* is a window with side branches beside its chain (specd.tree).
- a *round*: draft a window, verify it in one target forward, commit accepted + recovered/bonus.
- a *forward*: one target pass over every session's new tokens (a *step* of the batch); it
  verifies each session's window at once.
- a *verdict*: what verification says of a window (specd.verify.Verdict): how many drafts were
  accepted, the token after them, how many of those the strict rule kept.
- a *commit*: the verdict applied to the committed sequence (specd.speculation.round); the draft side
  acknowledges it, rolling back drafts past it.
- a *chunk*: a part of a window sent for verification before the rest is drafted (PEARL's
  overlap across the services).
- an *epoch*: the draft side's count of rollbacks; a draft of an older epoch is stale.
- a *multi-step run*: windows the target verifies back to back for one request, with no round
  trip between them: k = 0 windows (a stretch of rounds that do not draft, or the target
  alone), or windows the target drafts itself.
- the *decode cost*: seconds of one plain decoding step of one session now (specd.cost_model's
  `decode_cost`); every other target cost is priced against it.
- p: target distribution, q: draft distribution, x: a draft token, H(q): entropy in nats.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specd.errors import InvalidRequest
from specd.grammar import GrammarSpec

# Limits of what one request may ask, checked before any work (and before any conversion to
# protobuf, whose integers and strings are narrower than JSON's and Python's).
MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_STOP_CHARS = 256
MAX_SEED = 2**63 - 1
MAX_TOP_K = 1 << 20
MAX_POLICY_PARAMS = 32
MAX_NAME_CHARS = 64  # a policy's name, a policy parameter's name
TASK_TAG = re.compile(r"[A-Za-z0-9_.:/@-]{1,64}")
MAX_DRAFT_TOKENS = 256
MAX_BRANCHES = 16  # side branches of a draft tree (specd.tree)
MAX_LOGIT_BIAS = 1024  # logit_bias entries


def check_text(field_name: str, text: str) -> None:
    """InvalidRequest unless text is encodable Unicode: a JSON string may carry a lone
    surrogate (e.g. "\\ud800"), which no tokenizer, protobuf or Redis can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(field_name, f"is not valid Unicode: a lone surrogate at character {e.start}") from None


def check_branch_count(branches: int | None) -> None:
    """InvalidRequest naming `branches` for side branches of a draft tree out of [0, MAX_BRANCHES]."""
    if branches is not None and not 0 <= branches <= MAX_BRANCHES:
        raise InvalidRequest("branches", f"must be in [0, {MAX_BRANCHES}], got {branches}")


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. temperature 0 means greedy; top_k 0 and top_p 1 mean off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    # What changes the target's logits before they are judged (specd.penalties), at every
    # position of a window as at the target alone's: OpenAI's presence and frequency penalties
    # (over the generated tokens), the repetition penalty (over prompt and generated tokens;
    # 1: off) and a bias per token id, as sorted (id, bias) pairs.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: GrammarSpec | None = None  # structured output: the target's logits masked (specd.grammar)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are changed before they are judged (penalties, a bias, a grammar)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.grammar)

    @property
    def coupled(self) -> bool:
        """Seeded sampling draws every token from the seed and its position alone
        (specd.sampling.race_noise), so the output is the target alone's for that seed
        whatever was drafted."""
        return not self.greedy and self.seed is not None

    def validate(self, max_new_tokens_limit: int = 1 << 20) -> None:
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0):
            raise InvalidRequest("temperature", f"must be in [0, 100], got {self.temperature}")
        if not (0 <= self.top_k <= MAX_TOP_K):
            raise InvalidRequest("top_k", f"must be in [0, {MAX_TOP_K}] (0 disables it), got {self.top_k}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p}")
        if not (1 <= self.max_new_tokens <= max_new_tokens_limit):
            raise InvalidRequest(
                "max_new_tokens", f"must be in [1, {max_new_tokens_limit}], got {self.max_new_tokens}")
        if self.seed is not None and not (0 <= self.seed <= MAX_SEED):
            raise InvalidRequest("seed", f"must be in [0, 2**63 - 1], got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_CHARS:
                raise InvalidRequest("stop", f"stop strings must have 1 to {MAX_STOP_CHARS} characters, "
                                             f"got {len(s)}")
            check_text("stop", s)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise InvalidRequest(name, f"must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0):
            raise InvalidRequest("repetition_penalty", f"must be in (0, 10] (1 disables it), got "
                                                       f"{self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if not 0 <= token < 1 << 31:
                raise InvalidRequest("logit_bias", f"keys are token ids >= 0, got {token}")
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise InvalidRequest("logit_bias", f"biases must be in [-100, 100], got {bias} for token {token}")
        if self.grammar is not None:
            self.grammar.validate()


@dataclass(frozen=True)
class SpecParams:
    """How to speculate. policy "none" decodes with the target alone (the baseline).

    policy_params override the policy's defaults by name (e.g. {"h": 0.4} for svip);
    max_draft_tokens, when set, replaces the policy's own cap. relaxed turns on AdaSD's lossy
    JS-distance verification (adasd only). task_tag keys the shared adaptive state. branches:
    side branches verified beside the policy's chain as a draft tree (specd.tree; lookup
    drafters only; None: the drafter's default, 0: chains only).
    """

    policy: str = "constant"
    max_draft_tokens: int | None = None
    policy_params: dict = field(default_factory=dict)
    task_tag: str = "default"
    relaxed: bool = False
    branches: int | None = None

    def validate(self, max_draft_tokens_limit: int = MAX_DRAFT_TOKENS) -> None:
        """The request-independent limits; the policy checks its parameters' values itself.
        max_draft_tokens_limit: a server's cap on a window (services: the coordinator's
        max_draft_tokens), for max_draft_tokens given either way, field or policy parameter."""
        check_text("policy", self.policy)
        if not 1 <= len(self.policy) <= MAX_NAME_CHARS:
            raise InvalidRequest("policy", f"must be a policy name of 1 to {MAX_NAME_CHARS} characters")
        if not TASK_TAG.fullmatch(self.task_tag):
            raise InvalidRequest("task_tag", "must be 1 to 64 characters among letters, digits and _ . : / @ -")
        limit = min(max_draft_tokens_limit, MAX_DRAFT_TOKENS)
        if self.max_draft_tokens is not None and not 1 <= self.max_draft_tokens <= limit:
            raise InvalidRequest("max_draft_tokens", f"must be in [1, {limit}], got {self.max_draft_tokens}")
        if len(self.policy_params) > MAX_POLICY_PARAMS:
            raise InvalidRequest("policy_params", f"at most {MAX_POLICY_PARAMS} parameters, "
                                                  f"got {len(self.policy_params)}")
        for name, value in self.policy_params.items():
            check_text("policy_params", name)
            if not 1 <= len(name) <= MAX_NAME_CHARS:
                raise InvalidRequest("policy_params", f"parameter names have 1 to {MAX_NAME_CHARS} characters")
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise InvalidRequest(f"policy_params.{name}", f"must be a finite number, got {value!r}")
            if name == "max_draft_tokens" and value > limit:
                raise InvalidRequest("policy_params.max_draft_tokens", f"must be in [1, {limit}], got {value!r}")
        check_branch_count(self.branches)


@dataclass(slots=True)
class DraftStep:
    """What a stopping policy sees after each drafted token (built per draft token: not frozen,
    which is several times slower to build)."""

    index: int  # 1-based count of tokens drafted this round, this one included
    position: int  # index of this token among the generated tokens (0 = first generated)
    token: int  # the draft token x
    prob: float  # q(x)
    max_prob: float  # max_v q(v)
    entropy: float  # H(q) in nats
    hidden: torch.Tensor | None = None  # draft's last hidden state that produced q ([hidden])
    match_len: int = 0  # n-gram drafters: length of the matched suffix this token continues (else 0)
    retrieved: bool = False  # retrieval: the match is in the datastore, not in this request's text
    # n-gram drafters: how many occurrences of the match voted on this token (those whose text
    # agreed with the window so far; 0: unknown), and the share of them it follows
    votes: int = 0
    support: float = 1.0
    noise: float = -1.0  # coupled sampling: E(x), the race noise of x at its position (< 0: not coupled)


@dataclass(frozen=True, slots=True)
class RoundOutcome:
    """What verification decided about one round, fed back to the policy."""

    num_drafted: int
    num_accepted: int  # strictly accepted (relaxed acceptances are not counted here)
    entropies: tuple[float, ...]  # H(q) of each drafted token, in draft order
    hit_cap: bool  # drafting ended at the hard cap, not by the policy's own decision
    js_distances: tuple[float, ...] = ()  # JS(p, q) per verified position (relaxed mode only)
    steps: tuple[DraftStep, ...] = ()  # what the policy saw for each drafted token, in draft order
    # A token the policy dropped after the kept ones (Decision.DROP), and whether the target's
    # next token turned out to be that token (None when a kept draft was rejected first).
    dropped: DraftStep | None = None
    dropped_accepted: bool | None = None

    @classmethod
    def judged(cls, steps: Sequence[DraftStep], num_accepted: int, hit_cap: bool,
               js_distances: Sequence[float] = (), dropped: DraftStep | None = None,
               next_token: int | None = None) -> RoundOutcome:
        """The outcome of a chain of drafted steps whose leading num_accepted were strictly
        accepted; next_token: the target's token after them (None: not known yet), which
        judges a dropped token when the whole chain was accepted."""
        dropped_accepted = None
        if dropped is not None and num_accepted == len(steps) and next_token is not None:
            dropped_accepted = next_token == dropped.token
        return cls(len(steps), num_accepted, tuple(s.entropy for s in steps), hit_cap, tuple(js_distances),
                   tuple(steps), dropped, dropped_accepted)

    @property
    def all_accepted(self) -> bool:
        return self.num_accepted == self.num_drafted
